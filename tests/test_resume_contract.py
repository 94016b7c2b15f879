"""What the gateway's resumption relies on from the engine (gateway/resume.py): a continuation
(prompt + the first k generated tokens, budget reduced by k) generates what the uninterrupted run
generated after those k tokens — greedy with or without speculation, and seeded sampling without
speculation, whose randomness is keyed by (seed, absolute position): the continuation's prompt
holds the k tokens, so every later token keeps its absolute position. The sampled continuations
are the gateway's own (`continuation`), read back off the wire as the target reads them.
In-process engine, tiny random models (tests/conftest.py)."""

from __future__ import annotations

import pytest
from tests.support.engine_harness import run_engine

from gateway.resume import continuation
from specstream.data.engine import SequenceRequest
from specstream.data.engine_wire import request_from_pb, request_to_pb
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
    # As the target reads them off the wire (top_p in float32), for the whole run and the rest alike.
    originals = [request_from_pb(request_to_pb(SequenceRequest(str(i), p, 20, sampling=s)))
                 for i, (p, s) in enumerate(zip(PROMPTS, params))]
    whole, _ = run_engine(target, None, PROMPTS, 0, 20, sampling=[o.sampling for o in originals])
    resumed = [request_from_pb(request_to_pb(continuation(o, w[:k]))) for o, w in zip(originals, whole)]
    assert [r.sampling for r in resumed] == [o.sampling for o in originals]  # the seed travels unchanged
    rest, _ = run_engine(target, None, [r.prompt_token_ids for r in resumed], 0, [r.max_new_tokens for r in resumed],
                         sampling=[r.sampling for r in resumed])
    assert [w[k:] for w in whole] == rest
    other, _ = run_engine(target, None, PROMPTS, 0, 20, sampling=[SamplingParams(temperature=1.0, seed=99)] * 2)
    assert other != whole  # the seed matters: the equality above is not by construction
