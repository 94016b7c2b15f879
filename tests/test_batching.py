"""Batching in the engine: each request's output is the same alone and inside a batch of 32 mixed
requests under every policy and row selection (greedy exactly, seeded sampling too), freed slots
are refilled as the policy says, long prompts are prefilled in chunks, and the run's batch
counters add up."""

from __future__ import annotations

import random

import pytest
from tests.support.engine_harness import naive_greedy, run_engine

from specstream.data.sampling import SamplingParams

N_REQUESTS = 32


def _workload(seed: int = 4) -> tuple[list[list[int]], list[SamplingParams]]:
    """32 prompts of 1-40 tokens; every other request samples with its own seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 30) for _ in range(rng.randint(1, 40))] for _ in range(N_REQUESTS)]
    params = [SamplingParams(temperature=0.9, top_k=8, seed=i) if i % 2 else SamplingParams() for i in range(N_REQUESTS)]
    return prompts, params


@pytest.fixture(scope="module")
def alone(sampling_pair):
    """Each request run by itself (one slot), for γ 0 and 4."""
    prompts, params = _workload()
    out = {}
    for gamma in (0, 4):
        out[gamma] = [run_engine(sampling_pair["target"], sampling_pair["draft"], [p], gamma, 12, max_slots=1,
                                 sampling=[s])[0][0] for p, s in zip(prompts, params)]
    return out


POLICIES = {"static": dict(policy="static"), "topup-1": dict(policy="topup", refill_threshold=1.0),
            "topup-0.5": dict(policy="topup", refill_threshold=0.5)}


@pytest.mark.parametrize("gamma", [0, 4])
@pytest.mark.parametrize("selection", ["all", "min_length", "fifo"])
@pytest.mark.parametrize("policy", POLICIES)
def test_output_is_the_same_alone_and_in_a_mixed_batch(sampling_pair, alone, policy, selection, gamma):
    prompts, params = _workload()
    # 12 resident rows, 6 expanded per step, prompts prefilled 16 tokens per step: rows differ
    # in length, γ, sampling settings and in which steps they are expanded.
    config = dict(POLICIES[policy], max_batch=6, row_selection=selection, prefill_chunk=16, max_wait_steps=3)
    steps: dict = {}
    tokens, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], prompts, gamma, 12, max_slots=12,
                                sampling=params, config=config, steps=steps)
    assert tokens == alone[gamma]
    assert all(len(t) == 12 for t in tokens)
    stats = steps["stats"]
    assert stats.admitted == N_REQUESTS and max(i for i, c in enumerate(stats.occupancy) if c) <= 6


def test_greedy_requests_alone_equal_plain_greedy(sampling_pair, alone):
    prompts, params = _workload()
    for i in range(0, N_REQUESTS, 8):  # greedy ones, spot-checked against full recomputation
        assert alone[0][i] == alone[4][i] == naive_greedy(sampling_pair["target"], prompts[i], 12)


def test_topup_reuses_a_freed_slot_in_the_next_step(sampling_pair):
    steps: dict = {}
    # Two slots: "0" finishes first (2 tokens), "1" runs long (20), "2" waits for a slot.
    run_engine(sampling_pair["target"], None, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 0, [2, 20, 2], max_slots=2,
               steps=steps, config=dict(policy="topup"))
    assert steps["2"][0] == steps["0"][-1] + 1
    assert steps["2"][-1] < steps["1"][-1]


def test_static_waits_for_the_batch_to_drain(sampling_pair):
    steps: dict = {}
    run_engine(sampling_pair["target"], None, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 0, [2, 20, 2], max_slots=2,
               steps=steps, config=dict(policy="static"))
    assert steps["2"][0] == steps["1"][-1] + 1  # the free slot stays empty until "1" is done too


def test_a_long_prompt_is_prefilled_in_chunks_without_stalling_others(sampling_pair):
    steps: dict = {}
    long_prompt = [i % 30 for i in range(45)]
    tokens, _ = run_engine(sampling_pair["target"], None, [[1, 2], long_prompt], 0, 8, max_slots=2, steps=steps,
                           config=dict(prefill_chunk=10))
    # The short request gets a token every step while the long prompt takes 5 steps to prefill.
    assert steps["0"][:5] == [1, 2, 3, 4, 5]
    assert steps["1"][0] >= 5
    assert steps["stats"].prefill_tokens == 2 + 45
    assert tokens[1] == naive_greedy(sampling_pair["target"], long_prompt, 8)


def test_batch_counters_add_up(sampling_pair):
    prompts, params = _workload()
    steps: dict = {}
    tokens, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], prompts, 4, 12, max_slots=8,
                                sampling=params, steps=steps)
    stats = steps["stats"]
    assert sum(stats.occupancy) == stats.steps
    assert sum(k * c for k, c in enumerate(stats.occupancy)) == stats.row_expansions
    proposed = sum(f.stats.draft_tokens for f in finals)
    assert stats.tokens_processed == stats.row_expansions + proposed
    assert stats.queued_steps > 0
    assert stats.queued_rows > 7.0 * stats.queued_steps  # topup keeps 8 slots busy while requests wait
