"""Tree forwards (``CausalLM.hidden(parents=...)``, specstream/models/attention.py ``CacheBatch``):
every node's final state is the bits of the chain forward through its ancestors on the native CPU
path (the attention op and the whole-stack op), in float32 and bfloat16, with and without a
sliding window, for random trees (depth <= 8, width <= 4) in ragged batches. This is what lets
tree verification reproduce plain greedy decoding token for token; the engine verifies trees only
where that path serves. The torch path (GPU, or the library off) computes the same attention, but
its matrix products round differently with the number of keys (as its chains do, rarely, too), so
there it is checked to float tolerance."""

from __future__ import annotations

import random

import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE

from kernels import native
from specstream.models.loader import load_model
from specstream.models.random_init import write_random_checkpoint

LLAMA = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def random_tree(rng: random.Random, nodes: int, max_depth: int = 8, max_width: int = 4) -> list[int]:
    """Parents of up to ``nodes`` nodes (node 0 the root, -1): each node hangs under an earlier one
    that has fewer than ``max_width`` children and depth below ``max_depth`` (fewer nodes when
    none is left)."""
    parents, depth, children = [-1], [0], [0]
    for t in range(1, nodes):
        open_ = [p for p in range(t) if children[p] < max_width and depth[p] < max_depth]
        if not open_:
            break
        p = rng.choice(open_)
        parents.append(p)
        depth.append(depth[p] + 1)
        children[p] += 1
        children.append(0)
    return parents


def paths(parents: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for t, p in enumerate(parents):
        out.append([*out[p], t] if t else [0])
    return out


def _states(model, cache, rows: list[tuple[int, int, list[int]]], parents: list[list[int]] | None) -> torch.Tensor:
    """One forward over rows (slot, start, tokens) of equal length -> final states [B, T, H]."""
    ids = torch.tensor([tokens for _, _, tokens in rows])
    tree = torch.tensor(parents, dtype=torch.int64) if parents is not None else None
    with torch.inference_mode():
        return model.hidden(ids, cache, torch.tensor([s for s, _, _ in rows]),
                            torch.tensor([start for _, start, _ in rows]), parents=tree)


def _check_trees(model, seed: int, batch: int, nodes: int, exact: bool = True) -> int:
    """Prefills ragged prefixes, verifies one random tree per row in one forward, and compares each
    node with the chain forward along its path (own slots, same prefix). Returns nodes checked."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    cache = model.new_cache(2 * batch, 128)
    slots = [cache.alloc() for _ in range(2 * batch)]
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(batch)]
    for b, prefix in enumerate(prefixes):  # the tree's slot and the chains' slot get the same prefix
        _states(model, cache, [(slots[2 * b], 0, prefix), (slots[2 * b + 1], 0, prefix)], None)
    trees = [random_tree(rng, nodes) for _ in range(batch)]
    tokens = [[rng.randrange(vocab) for _ in range(nodes)] for _ in range(batch)]
    got = _states(model, cache, [(slots[2 * b], len(prefixes[b]), tokens[b]) for b in range(batch)], trees)
    checked = 0
    for b in range(batch):
        node_paths = paths(trees[b])
        leaves = [t for t in range(nodes) if t not in trees[b]]
        for leaf in leaves:
            path = node_paths[leaf]
            want = _states(model, cache, [(slots[2 * b + 1], len(prefixes[b]), [tokens[b][t] for t in path])], None)
            for d, t in enumerate(path):
                if exact:
                    assert torch.equal(got[b, t], want[0, d]), (b, t, d, path)
                else:
                    torch.testing.assert_close(got[b, t], want[0, d], rtol=1e-4, atol=1e-5 if
                                               got.dtype == torch.float32 else 2e-2)
                checked += 1
    return checked


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tree") / "llama", LLAMA, seed=11)


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory):
    from tests.support.checkpoints import make_hf_checkpoint  # a Mistral with a window shorter than the prefixes

    return make_hf_checkpoint(tmp_path_factory.mktemp("tree") / "mistral", "mistral", vocab_size=96, seed=12)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_tree_node_is_the_chain_through_it(llama_dir, dtype, native_on, monkeypatch) -> None:
    if not native_on:
        monkeypatch.setenv("SPECSTREAM_NATIVE", "0")
    assert (native.library() is not None) == native_on
    model = load_model(llama_dir, dtype=dtype)
    assert sum(_check_trees(model, seed, batch=3, nodes=12, exact=native_on) for seed in range(3)) > 0


@NEEDS_Q4_NATIVE
def test_a_4bit_model_on_the_whole_stack_op_too(llama_dir) -> None:
    model = load_model(llama_dir, dtype="bfloat16", weights="int4-rtn")
    assert model.native_runs(torch.bfloat16)[0][1] is not None  # the whole-stack op serves
    assert _check_trees(model, seed=4, batch=2, nodes=16) > 0


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_sliding_window_trees(window_dir, native_on, monkeypatch) -> None:
    if not native_on:
        monkeypatch.setenv("SPECSTREAM_NATIVE", "0")
    model = load_model(window_dir, dtype="float32")
    assert _check_trees(model, seed=5, batch=2, nodes=14, exact=native_on) > 0


def test_gpt2_trees(tmp_path) -> None:
    from tests.support.checkpoints import make_hf_checkpoint

    model = load_model(make_hf_checkpoint(tmp_path / "gpt2", "gpt2", vocab_size=96, seed=13), dtype="float32")
    assert _check_trees(model, seed=6, batch=2, nodes=10, exact=False) > 0  # the torch path: no native GPT-2


def test_a_chain_given_as_parents_is_the_chain_forward(llama_dir) -> None:
    model = load_model(llama_dir, dtype="float32")
    cache = model.new_cache(2, 64)
    a, b = cache.alloc(), cache.alloc()
    tokens = list(range(5, 15))
    chain = _states(model, cache, [(a, 0, tokens)], None)
    given = _states(model, cache, [(b, 0, tokens)], [list(range(-1, 9))])
    assert torch.equal(chain, given)


@pytest.mark.parametrize("parents", [[0, 0, 1], [-1, 1, 0], [-1, 0, 3], [-1, -1, 0]])
def test_bad_parents_are_refused_naming_them(llama_dir, parents) -> None:
    model = load_model(llama_dir, dtype="float32")
    cache = model.new_cache(1, 32)
    with pytest.raises(ValueError, match="parents of row 0"):
        _states(model, cache, [(cache.alloc(), 0, [1, 2, 3])], [parents])
