"""The target's prefix cache (specstream/models/prefix_cache.py): what it keeps, what it shares, and
that a sequence served from it gives exactly the tokens and draws it gives with the cache off."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from draft_service.feature import FeatureProposer
from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest
from specstream.data.errors import InvalidArgumentError
from specstream.data.prefix import BLOCK, MAX_SALT_CHARS, block_keys, caller_salt, reusable_blocks
from specstream.data.request_rules import check_cache_salt
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.models.feature_draft import load_feature_draft
from specstream.models.kv_cache import KVCache
from specstream.models.loader import load_model
from target_service.engine import Engine
from target_service.inprocess import generate
from target_service.local_draft import LocalDraft
from specstream.models.prefix_cache import PrefixCache
from tests.support.engine_harness import naive_greedy, speculation
from tests.support.feature_pair import PROMPTS as FEATURE_PROMPTS

ROW = 4  # bytes of one position's features in the unit tests


def _kv(slots: int = 6) -> KVCache:
    return KVCache(num_layers=1, num_slots=slots, num_kv_heads=1, max_len=128, head_dim=2, dtype=torch.float32)


def _retired(kv: KVCache, prefix: PrefixCache, tokens: list[int], salt: str = "", features: bool = True) -> int:
    slot = kv.alloc()
    kv.set_length(slot, len(tokens))
    assert prefix.retire(slot, tokens, salt, bytearray(len(tokens) * ROW) if features else None, ROW)
    return slot


# ----- keys and rules ------------------------------------------------------------------------------------

def test_block_keys_chain_every_token_before_them_and_the_salt():
    tokens = list(range(50))
    keys = block_keys(tokens)
    assert len(keys) == 50 // BLOCK and len(set(keys)) == len(keys)
    assert block_keys(tokens[:40]) == keys[:2]  # a key names its whole prefix, whatever follows
    changed = block_keys([99, *tokens[1:]])
    assert all(a != b for a, b in zip(keys, changed))  # the first token changes every later key
    assert all(a != b for a, b in zip(keys, block_keys(tokens, "tenant-a")))
    assert block_keys(tokens, "tenant-a") != block_keys(tokens, "tenant-b")
    assert reusable_blocks(33) == 2 and reusable_blocks(32) == 1 and reusable_blocks(1) == 0  # the last token is computed


def test_a_salt_is_bounded_and_a_token_salts_its_callers_apart():
    check_cache_salt("x" * MAX_SALT_CHARS)
    with pytest.raises(InvalidArgumentError) as err:
        check_cache_salt("x" * (MAX_SALT_CHARS + 1))
    assert err.value.field == "cache_salt" and "257 characters" in str(err.value)
    assert caller_salt(None, "s") == "s" and caller_salt("", "s") == "s"
    a, b = caller_salt("Bearer one", ""), caller_salt("Bearer two", "")
    assert a != b and a != "" and len(a) == 64  # a digest: the token itself never travels on
    assert caller_salt("Bearer one", "x") != a  # the request's own salt still counts


# ----- the cache's own bookkeeping -------------------------------------------------------------------------

def test_a_finished_prompt_is_found_by_its_full_blocks_and_only_under_its_salt():
    kv = _kv()
    prefix = PrefixCache(kv, capacity=2)
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks
    slot = _retired(kv, prefix, tokens, salt="a")
    assert prefix.lookup(tokens + [7], "b") is None  # another salt never hits
    hit = prefix.lookup(tokens + [7], "a", ROW)
    assert (hit.slot, hit.length, hit.take_over) == (slot, 48, True)  # its next turn takes the slot over
    assert hit.features == bytes(48 * ROW)
    hit = prefix.lookup(tokens[:20] + [1, 2, 3], "a")
    assert (hit.length, hit.take_over) == (16, False)  # a shorter match forks: the entry keeps its tail
    assert prefix.lookup(tokens[:16], "a") is None  # the last token is always computed: no full block before it
    assert prefix.lookup([5, *tokens[1:]], "a") is None
    assert (prefix.queries, prefix.hits, prefix.hit_tokens) == (5, 2, 64)


def test_a_key_is_a_lookup_not_a_proof_tokens_are_compared():
    kv = _kv()
    prefix = PrefixCache(kv, capacity=2)
    tokens = list(range(40))
    slot = _retired(kv, prefix, tokens)
    prefix.entries[slot].tokens[3] = 999  # as if another prompt had the same keys (a collision)
    assert prefix.lookup(tokens + [1], "") is None


def test_a_sequence_that_needs_features_only_reuses_an_entry_that_kept_them():
    kv = _kv()
    prefix = PrefixCache(kv, capacity=2)
    tokens = list(range(40))
    _retired(kv, prefix, tokens, features=False)
    assert prefix.lookup(tokens + [1], "", ROW) is None  # recomputed, never drafted without features
    assert prefix.lookup(tokens + [1], "").length == 32


def test_the_least_recently_used_is_evicted_and_one_read_by_others_last():
    kv = _kv(slots=6)
    prefix = PrefixCache(kv, capacity=2)
    a = _retired(kv, prefix, [1] * 40)
    b = _retired(kv, prefix, [2] * 40)
    reader = kv.alloc()
    kv.fork(a, reader)  # a running sequence reads a's positions
    assert prefix.lookup([1] * 40 + [3], "").slot == a  # a is now the most recent too
    c = _retired(kv, prefix, [3] * 40)  # over capacity: b goes (a is read and more recent)
    assert set(prefix.entries) == {a, c} and not kv.is_allocated(b)
    assert prefix.freeable(pinned={a}) == 1 and prefix.freeable(pinned=set()) == 2
    assert prefix.evict() and set(prefix.entries) == {a}  # c: read by no one
    assert prefix.evict() and not prefix.entries
    assert kv.num_free == 6 - 2  # a is held back by the KV cache while its reader runs
    kv.free(reader)
    assert kv.num_free == 6


def test_a_running_prompt_is_forked_never_taken_over():
    kv = _kv()
    prefix = PrefixCache(kv, capacity=1)
    slot = kv.alloc()
    tokens = list(range(40))
    kv.set_length(slot, 40)
    prefix.add_live(slot, tokens, "", None, 0)
    hit = prefix.lookup(tokens + [5], "")
    assert (hit.slot, hit.length, hit.take_over) == (slot, 32, False)
    assert prefix.retained == 0 and not prefix.evict()  # a running sequence's slot is its own
    prefix.drop(slot)
    assert prefix.lookup(tokens + [5], "") is None


# ----- reading a shared prefix: the bits of a contiguous read ------------------------------------------------

@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_read_through_a_source_table_gives_the_bits_of_its_own_copy(tmp_path, monkeypatch, native, head_dim,
                                                                            dtype):
    """A forked slot reads its first positions from the slot that holds them. The native attention
    reads them with the arithmetic of its own slot's (the AVX-512 path included, which serves head
    sizes 64 and 128), so a prompt continued from a cached prefix gets the logits of one prefilled
    alone, bit for bit; so does the torch path."""
    from specstream.models.random_init import write_random_checkpoint

    monkeypatch.setenv("SPECSTREAM_NATIVE", native)
    write_random_checkpoint(tmp_path, {"vocab_size": 256, "hidden_size": 2 * head_dim, "intermediate_size": 256,
                                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                       "max_position_embeddings": 256}, seed=4)
    model = load_model(tmp_path, dtype=dtype)
    prompt = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))  # [1, 70]
    cache = model.new_cache(3, 128)

    def logits(slot: int, start: int, ids: torch.Tensor) -> torch.Tensor:
        return model(ids, cache, torch.tensor([slot]), torch.tensor([start]))[0]  # [T, V]

    with torch.inference_mode():
        alone = logits(cache.alloc(), 0, prompt)
        holder = cache.alloc()
        logits(holder, 0, prompt[:, :32])
        cache.set_length(holder, 32)
        forked = cache.alloc()
        cache.fork(holder, forked)
        continued = logits(forked, 32, prompt[:, 32:])
    assert cache.sources(forked) == [holder] * 32
    assert torch.equal(continued, alone[32:])


# ----- the engine: hits, and the same tokens as without them ------------------------------------------------

def _engine(target: Path, draft: Path | None, kept: int, feature: bool = False, max_slots: int = 4) -> Engine:
    model = load_model(target)
    proposer = None
    draft_kept = -1 if kept else 0  # the cache off: the draft's too
    if draft is not None:
        proposer = (FeatureProposer(load_feature_draft(draft, Path), 16, 512, prefix_slots=draft_kept) if feature
                    else DraftProposer(load_model(draft), max_slots=16, max_seq_len=512, prefix_slots=draft_kept))
    config = TargetConfig(model=ModelSpec(str(target)), max_slots=max_slots, max_seq_len=512, max_gamma=8,
                          prefix_cache_slots=kept, calibrate=False)
    return Engine(model, config, LocalDraft(proposer) if proposer else None)


def _request(rid: str, prompt: list[int], gamma: int | None, sampling: SamplingParams = GREEDY,
             max_new: int = 12, salt: str = "") -> SequenceRequest:
    return SequenceRequest(rid, list(prompt), max_new, speculation=speculation(gamma), sampling=sampling,
                           cache_salt=salt)


def _in_order(engine: Engine, batches: list[list[SequenceRequest]]) -> list:
    """Each batch submitted together once the one before has finished; every request's result."""

    async def main():
        loop = asyncio.create_task(engine.run())
        try:
            return [done for batch in batches for done in await generate(engine, batch, 60)]
        finally:
            loop.cancel()

    return asyncio.run(main())


def _conversation(engine: Engine, gamma: int | None, sampled: bool) -> list[tuple[list[int], int]]:
    """Requests a chat application and an agent send, in order, on one engine: each one's tokens
    and cached prompt tokens. Turn 2 continues turn 1 (a take-over), a request shares only turn
    1's first blocks (a fork from a kept slot), and a prompt arrives while another with the same
    start runs (a fork from a running sequence); a salted one shares nothing."""
    rng = random.Random(3)
    vocab = engine.model.config.vocab_size
    system = [rng.randrange(2, vocab) for _ in range(37)]
    turn1 = system + [rng.randrange(2, vocab) for _ in range(9)]

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=40, seed=100 + i) if sampled else GREEDY

    async def main():
        loop = asyncio.create_task(engine.run())
        out = {}  # by request: 4 and 5 run side by side and may finish in either order

        async def one(rid: int, prompt: list[int], salt: str = "") -> list[int]:
            [done] = await generate(engine, [_request(str(rid), prompt, gamma, sampling(rid), salt=salt)], 60)
            out[rid] = (done.token_ids, done.cached_tokens)
            return done.token_ids

        try:
            answer = await one(1, turn1)
            await one(2, turn1 + answer + [rng.randrange(2, vocab) for _ in range(5)])
            await one(3, system[:34] + [rng.randrange(2, vocab) for _ in range(6)])
            long_running = asyncio.create_task(one(4, system + [7] * 30))
            while not any(s.request_id == "4" and s.generated for s in engine.running):
                await asyncio.sleep(0.001)
            await one(5, system + [7] * 30 + [8])  # forks 4's prompt while 4 runs
            await long_running
            await one(6, turn1, salt="other tenant")
        finally:
            loop.cancel()
        return [out[rid] for rid in sorted(out)]

    return asyncio.run(main())


@pytest.mark.parametrize("draft, gamma, sampled", [(None, 0, False), ("same", 3, False), ("partial", None, False),
                                                   ("partial", 2, True), (None, 0, True), ("feature", 3, False),
                                                   ("feature", 2, True), ("feature", None, False)])
def test_served_from_the_cache_gives_the_tokens_and_draws_of_no_cache(model_zoo, feature_pair, draft, gamma, sampled):
    """Exactness, bit for bit: the same requests in the same order, with the caches (the target's
    and the draft's: hits of every kind) and without them, give the same tokens, greedy and seeded
    sampling, plain and speculative (sampled at a fixed γ: under γ=auto the controller's choices
    follow measured times, and a sampled run's draws follow the proposals, with or without a
    cache). With the caches, the draft continued cached prefixes: a feature draft was sent no
    features for them."""
    feature = draft == "feature"
    target = feature_pair["target"] if feature else model_zoo["target"]
    draft_dir = feature_pair["draft"] if feature else (model_zoo[draft] if draft else None)
    engine = _engine(target, draft_dir, kept=4, feature=feature)
    cached = _conversation(engine, gamma, sampled)
    fresh = _conversation(_engine(target, draft_dir, kept=0, feature=feature), gamma, sampled)
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in fresh]
    assert all(n == 0 for _, n in fresh)
    hits = [n for _, n in cached]
    assert hits[0] == 0 and hits[1] >= 48 and hits[2] == 32 and hits[4] == 64 and hits[5] == 0, hits
    if draft is not None and gamma:  # (under γ=auto whether a row drafts follows measured times)
        proposer = engine.drafting.source.proposer
        assert proposer.prefixes.cache.hits >= 2, "turn 2 and the fork of a running prompt restore the draft's state"
        if feature:
            counts = engine.drafting.draft_prefix
            assert counts["restored"] >= 48 and counts["bytes_saved"] == counts["restored"] * 2 * proposer.feature_width


def test_a_thousand_distinct_prompts_keep_the_cache_bounded_and_nothing_leaks(model_zoo):
    """1,000 prompts of 17-130 tokens in batches of 4, half of them sharing their first 40 tokens,
    one in three batches with a request cancelled while it runs, and one engine step that fails
    (its sequences end with an error, as a target's do when a replica fails them over), on an
    engine with 4 running and 3 kept slots: the cache never keeps more than 3 slots nor indexes
    more blocks than they hold, every other slot is free again after each batch, and at the end
    the engine's books balance."""
    engine = _engine(model_zoo["target"], model_zoo["partial"], kept=3)
    rng = random.Random(5)
    vocab = engine.model.config.vocab_size
    shared = [rng.randrange(2, vocab) for _ in range(40)]  # half the prompts start alike: forks too
    failed_batch = 101
    real_prefill = engine._prefill_compute

    def failing_prefill(*args):
        if failing_prefill.armed:
            failing_prefill.armed = False
            raise RuntimeError("an injected failure")
        return real_prefill(*args)

    failing_prefill.armed = False
    engine._prefill_compute = failing_prefill
    most_blocks = 3 * (engine.max_len // BLOCK)

    async def main():
        loop = asyncio.create_task(engine.run())
        errors = 0
        try:
            for batch in range(250):
                requests = [_request(f"{batch}-{i}", (shared if i % 2 else []) + [rng.randrange(2, vocab) for _ in
                                                                    range(rng.randint(17, 90))],
                                     None, max_new=rng.randint(1, 4)) for i in range(4)]
                failing_prefill.armed = batch == failed_batch
                work = asyncio.create_task(generate(engine, requests, 60))
                if batch % 3 == 0:
                    await asyncio.sleep(0.001)
                    for conn in list(engine.connections):
                        engine.cancel(conn, [requests[0].id])
                errors += sum(d.finish_reason == "error" for d in await work)
                assert engine.prefix.retained <= 3 and len(engine.prefix.index) <= most_blocks
                assert engine.cache.num_free + engine.prefix.retained == engine.cache.num_slots
            assert errors > 0  # the injected failure ended the sequences of its step
            assert not engine.running and engine.load().free_slots == 4
            engine.prefix.clear()  # what is kept is all that holds slots
            assert engine.cache.num_free == engine.cache.num_slots and not engine.cache.shared
            assert not engine.prefix.entries and not engine.prefix.index
        finally:
            loop.cancel()

    asyncio.run(main())
    registry = engine.metrics.registry
    assert registry.get_sample_value("specstream:prefix_cache_hits_total") >= 400
    assert registry.get_sample_value("specstream:prefix_cache_queries_total") > \
        registry.get_sample_value("specstream:prefix_cache_hits_total")


def test_with_no_free_slot_a_hit_on_a_kept_forked_slot_is_taken_over_not_evicted(model_zoo):
    """One running slot and one kept: the second prompt forks the first's kept slot, which is then
    evicted for it and held while read; the third hits the second's kept slot when no slot is
    free. It takes that slot over (evicting it and forking from it would read a freed slot), and
    every answer is the one without a cache."""
    rng = random.Random(9)
    vocab = 250
    base = [rng.randrange(2, vocab) for _ in range(32)]
    prompts = [base + [rng.randrange(2, vocab) for _ in range(n)] for n in (30, 28, 20)]

    def answers(kept: int) -> list[tuple[list[int], int]]:
        done = _in_order(_engine(model_zoo["target"], None, kept, max_slots=1),
                         [[_request(str(i), prompt, 0)] for i, prompt in enumerate(prompts)])
        return [(d.token_ids, d.cached_tokens) for d in done]

    cached, fresh = answers(1), answers(0)
    assert [t for t, _ in cached] == [t for t, _ in fresh]
    assert [n for _, n in cached] == [0, 32, 32]


def test_room_is_counted_again_for_each_admission_when_a_hit_pins_a_kept_slot(model_zoo):
    """Two running slots and one kept: a finished prompt is kept while forked by the next, then
    two requests arrive together, the first forking the kept slot (pinning it), the second needing
    the slot its eviction was counted to free. The second waits a step instead of failing the
    batch, and both answer as without a cache."""
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, 250) for _ in range(n)]

    base = tokens(32)
    first, second, other = base + tokens(16), base + tokens(30), tokens(40)
    forking = second[:48] + tokens(10)

    def answers(kept: int) -> list[tuple[list[int], str]]:
        done = _in_order(_engine(model_zoo["target"], None, kept, max_slots=2),
                         [[_request("0", first, 0, max_new=30)], [_request("1", second, 0, max_new=30)],
                          [_request("x", forking, 0, max_new=5), _request("y", other, 0, max_new=5)]])
        return [(d.token_ids, d.finish_reason) for d in done]

    cached = answers(1)
    assert [reason for _, reason in cached] == ["length"] * 4
    assert cached == answers(0)


def test_a_turn_that_stops_inside_an_accepted_run_is_kept_with_its_features(feature_pair):
    """A stop id inside a run of accepted guesses ends the sequence there: the features of the
    guesses after it were computed, but they are not the sequence's. Only the committed positions'
    are kept, so a feature draft's next turn of the conversation is served from the cache (before,
    the turn was kept without features, and the next one missed)."""
    engine = _engine(feature_pair["target"], feature_pair["draft"], kept=8, feature=True)
    # The draft was trained on the target's greedy answers to these prompts: its guesses are accepted.
    starts = [prompt + naive_greedy(feature_pair["target"], prompt, 44) for prompt in FEATURE_PROMPTS]

    async def main():
        loop = asyncio.create_task(engine.run())
        try:
            out = []
            for i, text in enumerate(starts):
                prompt, stop = text[:20], text[20 + 4 + i]  # a stop id a few tokens into the answer
                first = _request(f"a{i}", prompt, 3, max_new=16)
                first.stop_token_ids = frozenset({stop})
                [one] = await generate(engine, [first], 60)
                [two] = await generate(engine, [_request(f"b{i}", prompt + one.token_ids + [3, 4, 5], 3)], 60)
                out.append((one, two))
            return out
        finally:
            loop.cancel()

    turns = asyncio.run(main())
    assert all(one.finish_reason == "stop" for one, _ in turns)
    assert sum(one.final.stats.accepted_tokens for one, _ in turns) > 0  # guesses were accepted
    for one, two in turns:
        kept = (20 + len(one.token_ids) - 1) // BLOCK * BLOCK  # every committed position's full blocks
        assert two.cached_tokens == kept, (one.token_ids, one.final.stats, two.cached_tokens)


@pytest.mark.parametrize("draft, gamma", [(None, 0), ("feature", 3)])
def test_requests_sent_together_with_one_prompt_prefill_it_once(model_zoo, feature_pair, draft, gamma):
    """One batch: a request sharing only the first block of a 72-token prompt, then three with
    that prompt (agents' calls sent together, or a request's samples). The first two are admitted
    at once (a quarter of a prompt in common is not worth waiting for) and both prefill; the last
    two wait for the prompt's prefill and fork its four full blocks (8 tokens each left to
    compute). The same tokens as with no cache, greedy and seeded sampling."""
    target = feature_pair["target"] if draft else model_zoo["target"]
    draft_dir = feature_pair["draft"] if draft else None
    rng = random.Random(11)
    vocab = load_model(target).config.vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(72)]
    other = prompt[:16] + [rng.randrange(2, vocab) for _ in range(56)]
    batch = [_request(str(i), p, gamma, SamplingParams(temperature=0.8, seed=i) if i == 2 else GREEDY)
             for i, p in enumerate([other, prompt, prompt, prompt])]
    cached_engine = _engine(target, draft_dir, kept=4, feature=bool(draft))
    cached = _in_order(cached_engine, [batch])
    fresh_engine = _engine(target, draft_dir, kept=0, feature=bool(draft))
    fresh = _in_order(fresh_engine, [batch])
    assert [d.token_ids for d in cached] == [d.token_ids for d in fresh]
    assert [d.cached_tokens for d in cached] == [0, 0, 64, 64]
    assert cached_engine.stats.prefill_tokens == 72 + 72 + 8 + 8
    assert fresh_engine.stats.prefill_tokens == 4 * 72
