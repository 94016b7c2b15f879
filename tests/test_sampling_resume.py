"""Randomness keyed by position: a request resubmitted as (prompt + the tokens generated so far,
the remaining budget) with the same seed continues with exactly the tokens the uninterrupted run
produced — for plain sampling, for greedy decoding with or without speculation, and for sampling
with speculation under coupled verification (`speculative_sampling="coupled"`), which also makes a
speculative sampled run token for token the plain sampled run whatever γ is. Under Leviathan's
rule (the default) a resubmitted sampled request with speculation is exact in distribution but not
pinned (docs/architecture.md §7.1)."""

from __future__ import annotations

import pytest
from tests.support.engine_harness import run_engine

from specstream.data.sampling import SamplingParams

PROMPT = [5, 9, 17, 3, 22]
N = 24
CUTS = [0, 1, 2, 7, 16, 23]  # tokens already streamed when the request is resubmitted
SETTINGS = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=5, seed=11),
            SamplingParams(temperature=1.3, top_p=0.9, seed=1 << 63)]
COUPLED = {"speculative_sampling": "coupled"}


def _resumed(target, draft, full: list[int], gamma, params: SamplingParams, config: dict | None = None
             ) -> list[list[int]]:
    """For every cut k: the request resubmitted as PROMPT + full[:k] with N - k tokens to go."""
    prompts = [PROMPT + full[:k] for k in CUTS]
    tokens, finals = run_engine(target, draft, prompts, gamma, [N - k for k in CUTS], sampling=[params] * len(CUTS),
                                config=config)
    assert all(f.finish_reason == "length" for f in finals)
    return tokens


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "top_k", "top_p"])
def test_plain_sampling_resubmitted_continues_with_the_same_tokens(sampling_pair, params):
    (full,), _ = run_engine(sampling_pair["target"], None, [PROMPT], 0, N, sampling=[params])
    assert len(set(full)) > 3  # a real sample, not a constant
    for k, rest in zip(CUTS, _resumed(sampling_pair["target"], None, full, 0, params)):
        assert rest == full[k:], f"resubmitted after {k} tokens"
    other_seed = SamplingParams(params.temperature, params.top_k, params.top_p, params.seed ^ 1)
    (other,), _ = run_engine(sampling_pair["target"], None, [PROMPT], 0, N, sampling=[other_seed])
    assert other != full  # the seed matters: the equality above is not a constant output


@pytest.mark.parametrize("gamma", [0, 3, None], ids=["off", "fixed-3", "auto"])
def test_greedy_resubmitted_continues_with_the_same_tokens(sampling_pair, gamma):
    greedy = SamplingParams()
    (full,), _ = run_engine(sampling_pair["target"], sampling_pair["draft"], [PROMPT], gamma, N, sampling=[greedy])
    for k, rest in zip(CUTS, _resumed(sampling_pair["target"], sampling_pair["draft"], full, gamma, greedy)):
        assert rest == full[k:], f"resubmitted after {k} tokens"


@pytest.mark.parametrize("gamma", [1, 3, 6, None], ids=["fixed-1", "fixed-3", "fixed-6", "auto"])
def test_coupled_speculative_sampling_is_plain_sampling_token_for_token(sampling_pair, gamma):
    """40 seeded requests per setting through the draft, against the same requests decoded plainly:
    every token equal, while proposals were both accepted and rejected. Under speculation=auto the
    goodput controller finds that guessing does not pay for these tiny models' sampling rows (a
    sampling row's verification costs more than their forward), so auto runs Hugging Face's
    heuristic here, which always guesses and varies γ."""
    params = [SamplingParams(s.temperature, s.top_k, s.top_p, s.seed + i) for s in SETTINGS for i in range(40)]
    prompts = [PROMPT] * len(params)
    plain, _ = run_engine(sampling_pair["target"], None, prompts, 0, N, sampling=params, max_slots=32)
    spec, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], prompts, gamma, N, sampling=params,
                              max_slots=32, config=COUPLED | ({"gamma_policy": "hf"} if gamma is None else {}))
    assert spec == plain
    accepted = sum(f.stats.accepted_tokens for f in finals)
    assert 0 < accepted < sum(f.stats.draft_tokens for f in finals)


@pytest.mark.parametrize("gamma", [3, None], ids=["fixed-3", "auto"])
@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "top_k", "top_p"])
def test_coupled_speculative_sampling_resubmitted_continues_with_the_same_tokens(sampling_pair, gamma, params):
    target, draft = sampling_pair["target"], sampling_pair["draft"]
    (full,), finals = run_engine(target, draft, [PROMPT], gamma, N, sampling=[params], config=COUPLED)
    # Proposals were made and judged (under automatic γ the controller may guess rarely on a loaded
    # machine, and then none may be accepted; the fixed γ guarantees acceptances are exercised).
    assert finals[0].stats.draft_tokens > 0
    if gamma is not None:
        assert finals[0].stats.accepted_tokens > 0
    for k, rest in zip(CUTS, _resumed(target, draft, full, gamma, params, COUPLED)):
        assert rest == full[k:], f"resubmitted after {k} tokens"
    # ... and it is the text plain sampling gives for that seed.
    (plain,), _ = run_engine(target, None, [PROMPT], 0, N, sampling=[params])
    assert full == plain


def test_coupled_verification_of_a_model_free_proposer_is_plain_sampling_too(sampling_pair):
    """Point-mass proposals (q withheld, as from prompt lookup) under coupled verification."""
    from draft_service.proposer import DraftProposer
    from specstream.models.loader import load_model

    class PointMasses(DraftProposer):
        def propose(self, items):
            proposals = super().propose(items)
            for p in proposals:
                p.q_width, p.q_ids, p.q_probs = 0, [], []
            return proposals

    params = [SamplingParams(1.0, seed=100 + i) for i in range(40)]
    proposer = PointMasses(load_model(sampling_pair["draft"]), max_slots=64, max_seq_len=512)
    spec, finals = run_engine(sampling_pair["target"], None, [PROMPT] * 40, 3, N, sampling=params, max_slots=32,
                              proposer=proposer, config=COUPLED)
    plain, _ = run_engine(sampling_pair["target"], None, [PROMPT] * 40, 0, N, sampling=params, max_slots=32)
    assert spec == plain and sum(f.stats.accepted_tokens for f in finals) > 0
