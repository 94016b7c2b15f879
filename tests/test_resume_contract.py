"""What the gateway's resumption relies on from the engine (gateway/resume.py): a continuation
(prompt + the first k generated tokens, budget reduced by k) generates what the uninterrupted run
generated after those k tokens — greedy with or without speculation, and seeded sampling without
speculation, whose randomness is keyed by (seed, absolute position): the continuation's prompt
holds the k tokens, so every later token keeps its absolute position. In-process engine, tiny
random models (tests/conftest.py)."""

from __future__ import annotations

import pytest
from engine_harness import run_engine

from specstream.data.sampling import SamplingParams

PROMPTS = [[5, 9, 3, 17], [2, 8]]
NEW = 24


@pytest.mark.parametrize("gamma", [0, 3, None])  # off, fixed, auto
@pytest.mark.parametrize("k", [1, 7, 23])
def test_a_greedy_continuation_generates_the_rest_of_the_uninterrupted_run(model_zoo, gamma, k):
    target, draft = model_zoo["target"], model_zoo["partial"]
    whole, _ = run_engine(target, draft, PROMPTS, gamma, NEW)
    rest, _ = run_engine(target, draft, [p + w[:k] for p, w in zip(PROMPTS, whole)], gamma, NEW - k)
    assert [w[k:] for w in whole] == rest


@pytest.mark.parametrize("k", [1, 10, 19])
def test_a_seeded_sampled_continuation_without_speculation_generates_the_rest(sampling_pair, k):
    target = sampling_pair["target"]
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1234),
              SamplingParams(temperature=0.7, seed=2**63 + 5)]
    whole, _ = run_engine(target, None, PROMPTS, 0, 20, sampling=params)
    rest, _ = run_engine(target, None, [p + w[:k] for p, w in zip(PROMPTS, whole)], 0, 20 - k, sampling=params)
    assert [w[k:] for w in whole] == rest
    other, _ = run_engine(target, None, PROMPTS, 0, 20, sampling=[SamplingParams(temperature=1.0, seed=99)] * 2)
    assert other != whole  # the seed matters: the equality above is not by construction
