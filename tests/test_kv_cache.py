"""KVCache bookkeeping: slot pool, committed lengths, rollback without copies, copy_prefix."""

from __future__ import annotations

import pytest
import torch

from specstream.models.kv_cache import KVCache

LAYERS, SLOTS, HEADS, MAX_LEN, DIM = 3, 4, 2, 10, 8


@pytest.fixture
def cache() -> KVCache:
    return KVCache(LAYERS, SLOTS, HEADS, MAX_LEN, DIM, torch.float32)


def fill(cache: KVCache, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(cache.num_layers):
        cache.k[layer][slot].copy_(torch.randn(HEADS, MAX_LEN, DIM, generator=g))
        cache.v[layer][slot].copy_(torch.randn(HEADS, MAX_LEN, DIM, generator=g))


def test_layout(cache: KVCache) -> None:
    assert len(cache.k) == len(cache.v) == LAYERS
    for t in cache.k + cache.v:
        assert t.shape == (SLOTS, HEADS, MAX_LEN, DIM)
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        # Zero-filled so masked-out positions in a batched read can never inject NaN.
        assert not t.any()
    assert (cache.num_slots, cache.max_len) == (SLOTS, MAX_LEN)
    half = KVCache(1, 1, 1, 4, 2, torch.bfloat16)
    assert half.k[0].dtype == torch.bfloat16


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 1, 1, 0, 2, torch.float32)
    with pytest.raises(ValueError, match="num_slots"):
        KVCache(1, 0, 1, 4, 2, torch.float32)


def test_alloc_free_exhaustion(cache: KVCache) -> None:
    assert cache.num_free == SLOTS
    slots = [cache.alloc() for _ in range(SLOTS)]
    assert slots == [0, 1, 2, 3], "lowest slots first, all distinct"
    assert cache.num_free == 0
    assert cache.alloc() is None
    cache.set_length(2, 7)
    cache.free(2)
    assert cache.num_free == 1 and not cache.is_allocated(2) and cache.length(2) == 0
    assert cache.alloc() == 2
    assert cache.length(2) == 0, "a re-allocated slot starts empty"
    assert cache.alloc() is None


def test_free_errors(cache: KVCache) -> None:
    s = cache.alloc()
    assert s is not None
    cache.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(s)
    with pytest.raises(ValueError, match="out of range"):
        cache.free(SLOTS)
    with pytest.raises(ValueError, match="out of range"):
        cache.free(-1)
    assert cache.num_free == SLOTS, "failed frees must not corrupt the pool"


def test_set_length_bounds(cache: KVCache) -> None:
    s = cache.alloc()
    assert s is not None
    cache.set_length(s, MAX_LEN)
    assert cache.length(s) == MAX_LEN
    cache.set_length(s, 0)
    assert cache.length(s) == 0
    with pytest.raises(ValueError, match="out of range"):
        cache.set_length(s, MAX_LEN + 1)
    with pytest.raises(ValueError, match="out of range"):
        cache.set_length(s, -1)
    assert cache.length(s) == 0
    with pytest.raises(ValueError, match="not allocated"):
        cache.set_length(s + 1, 1)


def test_rollback_is_length_only(cache: KVCache) -> None:
    s = cache.alloc()
    assert s is not None
    fill(cache, s, seed=0)
    before = [t.clone() for t in cache.k]
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    cache.set_length(s, 8)
    cache.set_length(s, 3)
    assert cache.length(s) == 3
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs, "no reallocation"
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k)), "no data touched"


def test_copy_prefix(cache: KVCache) -> None:
    src, dst, bystander = cache.alloc(), cache.alloc(), cache.alloc()
    assert src is not None and dst is not None and bystander is not None
    fill(cache, src, seed=1)
    fill(cache, dst, seed=2)
    fill(cache, bystander, seed=3)
    dst_before = [(k[dst].clone(), v[dst].clone()) for k, v in zip(cache.k, cache.v)]
    src_before = [(k[src].clone(), v[src].clone()) for k, v in zip(cache.k, cache.v)]
    by_before = [(k[bystander].clone(), v[bystander].clone()) for k, v in zip(cache.k, cache.v)]
    cache.set_length(src, 6)
    cache.set_length(dst, 9)

    cache.copy_prefix(src, dst, 4)

    assert cache.length(dst) == 4 and cache.length(src) == 6
    for layer in range(LAYERS):
        for kind, store in enumerate((cache.k[layer], cache.v[layer])):
            assert torch.equal(store[dst, :, :4], src_before[layer][kind][:, :4])
            assert torch.equal(store[dst, :, 4:], dst_before[layer][kind][:, 4:]), "positions past n untouched"
            assert torch.equal(store[src], src_before[layer][kind]), "src unchanged"
            assert torch.equal(store[bystander], by_before[layer][kind])


def test_copy_prefix_errors_and_edge_cases(cache: KVCache) -> None:
    src, dst = cache.alloc(), cache.alloc()
    assert src is not None and dst is not None
    cache.set_length(src, 5)
    with pytest.raises(ValueError, match="length"):
        cache.copy_prefix(src, dst, 6)  # beyond what src has committed
    with pytest.raises(ValueError, match="not allocated"):
        cache.copy_prefix(src, SLOTS - 1, 2)
    cache.copy_prefix(src, dst, 0)
    assert cache.length(dst) == 0
    cache.copy_prefix(src, src, 3)  # same slot: a truncation
    assert cache.length(src) == 3


# -- shared prefixes (beam search) ----------------------------------------------------------------------------
def test_fork_shares_positions_without_copying(cache: KVCache) -> None:
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    for slot, seed in ((a, 1), (b, 2), (c, 3)):
        fill(cache, slot, seed)
    before = [t.clone() for t in cache.k + cache.v]
    cache.set_length(a, 5)
    cache.fork(a, b)  # b continues a after 5 positions
    assert cache.length(b) == 5 and cache.sources(b) == [a] * 5 and cache.sources(a) is None
    cache.set_length(b, 7)  # b's own positions 5, 6
    cache.fork(b, c)  # c reads 0..4 from a, 5..6 from b
    assert cache.sources(c) == [a] * 5 + [b] * 2 and cache.length(c) == 7
    assert all(torch.equal(x, y) for x, y in zip(cache.k + cache.v, before)), "fork moved K/V"
    cache.set_length(c, 6)  # a rollback inside the table shortens it
    assert cache.sources(c) == [a] * 5 + [b]
    cache.fork(c, c)  # a slot continuing itself: nothing changes
    assert cache.sources(c) == [a] * 5 + [b] and cache.length(c) == 6


def test_a_slot_others_read_is_freed_after_its_last_reader(cache: KVCache) -> None:
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.set_length(a, 4)
    cache.fork(a, b)
    cache.fork(a, c)
    cache.free(a)
    assert cache.num_free == SLOTS - 3 and not cache.is_allocated(a), "a is read by b and c: held back"
    cache.free(b)
    assert cache.num_free == SLOTS - 2  # b returns; a is still read by c
    cache.set_length(c, 2)  # c still reads a's positions 0, 1
    assert cache.num_free == SLOTS - 2
    cache.set_length(c, 0)  # nothing of a is read any more
    assert cache.num_free == SLOTS - 1 and not cache.shared
    cache.free(c)
    assert cache.num_free == SLOTS
    with pytest.raises(ValueError, match="not allocated"):
        cache.fork(a, c)


def test_copy_prefix_refuses_a_slot_that_reads_others(cache: KVCache) -> None:
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.set_length(a, 3)
    cache.fork(a, b)
    with pytest.raises(ValueError, match="use fork"):
        cache.copy_prefix(b, c, 2)


def test_attention_through_a_forked_slot_equals_a_copied_one() -> None:
    """A forward on a slot that reads its prefix from another gives the logits of one whose
    prefix was copied; writing inside the shared prefix is refused."""
    import tempfile

    from tests.support.checkpoints import make_hf_checkpoint

    from specstream.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_hf_checkpoint(tmp, "llama3_gqa", vocab_size=64, seed=5))
    cache = model.new_cache(4, 32)
    prompt = torch.randint(0, 64, (1, 9))
    src, forked, copied = cache.alloc(), cache.alloc(), cache.alloc()
    with torch.inference_mode():
        model(prompt, cache, torch.tensor([src]), torch.tensor([0]))
        cache.set_length(src, 9)
        cache.fork(src, forked)
        cache.copy_prefix(src, copied, 9)
        nxt = torch.randint(0, 64, (1, 3))  # positions 9..11, the same tokens in both slots
        # one batch: the forked slot's row (keys gathered per position) beside the copied one's
        both = model(nxt.expand(2, -1), cache, torch.tensor([forked, copied]), torch.tensor([9, 9]))  # [2, 3, V]
        # (rows of one float32 matrix product may round differently, hence a tolerance far below
        # what reading any other K/V would change)
        assert torch.allclose(both[0], both[1], atol=1e-5), "the forked slot reads the copied K/V"
        alone = model(nxt, cache, torch.tensor([copied]), torch.tensor([9]))  # [1, 3, V]
        assert torch.allclose(both[1], alone[0], atol=1e-5)
        with pytest.raises(ValueError, match="inside its shared prefix"):
            model(nxt, cache, torch.tensor([forked]), torch.tensor([5]))
