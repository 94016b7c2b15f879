"""Speculative sampling keeps the target's distribution exactly: chi-square tests through the engine.

Each configuration generates SAMPLES sequences from one prompt, each with its own seed, through the
real engine and the real draft proposer (in one process; the proposals are the same messages the
gRPC draft sends), and compares joint distributions of generated tokens with target-only sampling
(γ = 0, other seeds):
  - the first two tokens (t1 comes from the prefill pass, t2 from the first speculative step);
  - the last two, t_{γ+1} and t_{γ+2} of a γ+2 token generation: they come from the deepest
    proposals and the bonus token when a whole run is accepted, or from later steps after a
    rejection, so acceptance, residual and bonus at every depth and across steps are covered.
The draft (conftest `sampling_pair`) disagrees with the target in structured ways, so runs of all
lengths, rejections and residual draws all happen (acceptance ~0.65 per token).

False-alarm rate: every comparison is a chi-square test that fails when p < 1e-3, so for an exact
implementation each fails with probability 1e-3 over the choice of seeds; this file makes
9 first-pair + 27 last-pair speculative comparisons + 6 with automatic γ + 2 point-mass + 2
suffix-drafting + 2 vocabulary-subset + 2 feature-draft + 3 sampled-tree (first pair, last pair,
3-token sequences) comparisons + 9 goodness-of-fit checks = 62 distinct tests, at most 6.2%
together (union bound) for seeds drawn at random. The seeds are fixed, so the outcome of 56 of them is deterministic and CI never flakes on them. The 6 with automatic γ run Hugging Face's
rule (γ per row from what it accepted: it varies by row and step, and is fixed by the seeds too;
the goodput policy picks γ from measured step times, and on a loaded machine once kept one γ for a
whole run, which this test cannot use). They fail at p < 1e-5 (AUTO_THRESHOLD): 6e-5 for the six
together. (With 1e-3, one run failed at p = 8.8e-4; three runs at 20,000
sequences each then gave p = 0.28-0.64: no bias the test can see.)

Power: `test_the_test_catches_a_wrong_residual` shows the same test fails on a classic bug: sampling
from p instead of the residual after a rejection gives p ≈ 1e-16 with SAMPLES = 4,000 sequences per
configuration (1e-25 with 5,000; 5e-54 with 10,000; 1e-134 with 20,000), thirteen orders of
magnitude under 1e-3 and eleven under 1e-5, at 40% of the cost of 10,000 (this file is the suite's
longest: ~3 minutes of sampling at 10,000, ~2 at 5,000 beside the other workers).
"""

from __future__ import annotations

import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch
from tests.support.chi_square import _chi2_sf, goodness_of_fit_p_value, two_sample_p_value

SAMPLES = 4_000
PROMPT = [5, 9, 17, 3, 22]
TEMPERATURES = (0.7, 1.0, 1.5)
FILTERS = {"none": {}, "top_k": {"top_k": 5}, "top_p": {"top_p": 0.8}}
GAMMAS = (1, 3, 6)
LONGEST = max(GAMMAS) + 2  # the reference runs long enough for every γ's last pair
SPEC_SEED, REFERENCE_SEED = 0, 1 << 40  # disjoint seed ranges: the samples are independent
THRESHOLD = 1e-3
TREES = ((1.0, "none"),)  # sampled trees: γ 3 and 3 runner-ups, recursive rejection
AUTO_THRESHOLD = 1e-5  # the automatic-γ comparisons: random per run (see the module docstring)


# ----- sampling, in worker processes (two cores: two workers) ---------------------------------
def _init_worker(root: str) -> None:
    sys.path.insert(0, root)  # the repository: tests.support
    torch.set_num_threads(1)


def _generate(job: dict) -> list[list[int]]:
    """Runs SAMPLES sequences of one configuration through the engine; returns their tokens."""
    from tests.support.engine_harness import run_engine

    from specstream.data.sampling import SamplingParams
    from specstream.models.loader import load_model

    proposer = None
    if job["gamma"] and job.get("variant") == "point_mass":
        proposer = _PointMassProposer(load_model(job["draft"]), max_slots=2048, max_seq_len=24)
    if job.get("variant") == "suffix":  # suffix drafting: later rows draft from earlier rows' outputs too
        from draft_service.suffix import SuffixProposer
        proposer = SuffixProposer(2048, 24)
    if job.get("variant") == "wrong_residual":
        import kernels
        kernels.speculative_verify = _verify_with_wrong_residual
    params = [SamplingParams(temperature=job["temperature"], seed=job["seed"] + i, **job["filter"])
              for i in range(job["samples"])]
    auto = job.get("variant") == "auto"  # speculation=auto: the γ controller picks per row and step
    # Under auto, 64 rows a step: at 2,048 the controller rightly stops proposing after one step
    # (every proposal pads 2,048 rows), and the test needs γ to vary. Hugging Face's rule varies it
    # per row from what was accepted alone; the goodput policy follows measured step times, and on
    # a loaded machine it settled on one γ for a whole run.
    config = {"gamma_policy": "hf"} if auto else None
    if job.get("variant") == "tree":  # every drafting row proposes its chain and 3 runner-ups (next draws)
        config = {"gamma_policy": "fixed", "tree_branches": 3}
    tokens, finals = run_engine(job["target"], job["draft"] if job["gamma"] or auto else None,
                                [PROMPT] * job["samples"], None if auto else job["gamma"], job["max_new_tokens"],
                                max_slots=64 if auto or job.get("variant") == "suffix" else 2048, sampling=params, max_seq_len=24, proposer=proposer,
                                config=config)
    assert all(f.finish_reason == "length" for f in finals)  # the token budget, nothing else
    if auto:  # the controller really varied γ (not one fixed value, not all zero)
        used = {g for f in finals for g, n in enumerate(f.stats.gamma_histogram) if n and g}
        assert len(used) >= 2, used
    if (job["gamma"] or auto) and job.get("variant") != "wrong_residual":
        # The draft really proposed and was really both accepted and rejected.
        accepted = sum(f.stats.accepted_tokens for f in finals)
        assert 0 < accepted < sum(f.stats.draft_tokens for f in finals)
    if job.get("variant") == "tree":  # trees were verified, and tokens were kept off their chains
        assert sum(f.stats.branch_tokens for f in finals) > 0
    return tokens


class _PointMassProposer:
    """A model-free proposer stand-in: the draft's guesses, with q withheld (point masses)."""

    def __init__(self, model, **kwargs) -> None:
        from draft_service.proposer import DraftProposer
        self._inner = DraftProposer(model, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, items):
        proposals = self._inner.propose(items)
        for p in proposals:
            p.q_width, p.q_ids, p.q_probs = 0, [], []
        return proposals


def _verify_with_wrong_residual(p, q_ids, q_probs, draft, num_draft, u_accept, keys):
    """A classic bug: after a rejection, sample from p instead of norm(max(0, p - q))."""
    from kernels.random import race
    from tests.support.verify_oracle import speculative_verify_reference
    accepted, _ = speculative_verify_reference(p, q_ids, q_probs, draft, num_draft, u_accept, keys)
    rows = torch.arange(p.shape[0])
    return accepted, race(p.double()[rows, accepted], keys[rows, accepted])


def _jobs(pair: dict[str, Path]) -> dict[tuple, dict]:
    base = dict(target=str(pair["target"]), draft=str(pair["draft"]), samples=SAMPLES)
    jobs = {}
    for temperature in TEMPERATURES:
        for name, filt in FILTERS.items():
            jobs[("reference", temperature, name)] = dict(
                base, temperature=temperature, filter=filt, gamma=0, max_new_tokens=LONGEST, seed=REFERENCE_SEED)
            for gamma in GAMMAS:
                jobs[("speculative", temperature, name, gamma)] = dict(
                    base, temperature=temperature, filter=filt, gamma=gamma, max_new_tokens=gamma + 2, seed=SPEC_SEED)
    jobs[("point_mass", 1.0, "none", 3)] = dict(base, temperature=1.0, filter={}, gamma=3, max_new_tokens=5,
                                                seed=SPEC_SEED, variant="point_mass")
    jobs[("suffix", 1.0, "none", 3)] = dict(base, temperature=1.0, filter={}, gamma=3, max_new_tokens=5,
                                            seed=SPEC_SEED, variant="suffix")
    jobs[("wrong_residual", 1.0, "none", 1)] = dict(base, temperature=1.0, filter={}, gamma=1, max_new_tokens=3,
                                                    seed=SPEC_SEED, variant="wrong_residual")
    for temperature in TEMPERATURES:
        jobs[("auto", temperature, "none", 0)] = dict(base, temperature=temperature, filter={}, gamma=0,
                                                      max_new_tokens=LONGEST, seed=SPEC_SEED, variant="auto")
    jobs[("vocab_subset", 1.0, "none", 3)] = dict(base, draft=str(pair["draft_subset"]), temperature=1.0, filter={},
                                                  gamma=3, max_new_tokens=5, seed=SPEC_SEED)
    for temperature, name in TREES:
        jobs[("tree", temperature, name, 3)] = dict(base, temperature=temperature, filter=FILTERS[name], gamma=3,
                                                    max_new_tokens=5, seed=SPEC_SEED, variant="tree")
    jobs[("feature", 1.0, "none", 3)] = dict(base, draft=str(pair["feature_draft"]), temperature=1.0, filter={},
                                             gamma=3, max_new_tokens=5, seed=SPEC_SEED)
    return jobs


@pytest.fixture(scope="module")
def samples(sampling_pair) -> dict[tuple, list[list[int]]]:
    jobs = _jobs(sampling_pair)
    order = sorted(jobs, key=lambda key: -jobs[key]["max_new_tokens"] * (1 + jobs[key]["gamma"]))  # longest first
    with ProcessPoolExecutor(2, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(str(Path(__file__).parent.parent),)) as pool:
        futures = {key: pool.submit(_generate, jobs[key]) for key in order}
        return {key: future.result() for key, future in futures.items()}


# ----- statistics ----------------------------------------------------------------------------
def _pairs(tokens: list[list[int]], first: int) -> Counter:
    """Counts of (t_first, t_first+1), 1-based positions among the generated tokens."""
    return Counter((seq[first - 1], seq[first]) for seq in tokens)


def test_statistics_helpers_accept_and_reject():
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    same_a = Counter(torch.multinomial(p, 20000, replacement=True, generator=gen).tolist())
    same_b = Counter(torch.multinomial(p, 20000, replacement=True, generator=gen).tolist())
    other = Counter(torch.multinomial(torch.tensor([0.48, 0.32, 0.15, 0.05]), 20000, replacement=True,
                                      generator=gen).tolist())
    assert two_sample_p_value(same_a, same_b) > THRESHOLD
    assert two_sample_p_value(same_a, other) < THRESHOLD
    assert goodness_of_fit_p_value(same_a, p.tolist()) > THRESHOLD
    assert goodness_of_fit_p_value(other, p.tolist()) < THRESHOLD
    assert abs(_chi2_sf(3.841, 1) - 0.05) < 1e-3  # the textbook 95% point


# ----- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("filter_name", FILTERS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_speculative_sampling_matches_target_sampling(samples, temperature, filter_name, gamma):
    spec = samples[("speculative", temperature, filter_name, gamma)]
    reference = samples[("reference", temperature, filter_name)]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, gamma + 1), _pairs(reference, gamma + 1))
    assert first > THRESHOLD and last > THRESHOLD, (first, last)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_automatic_gamma_keeps_the_distribution(samples, temperature):
    """speculation=auto: γ differs by row and step (the controller's choice) and the output is
    still the target's distribution, at the first pair and at the deepest pair (t7, t8)."""
    spec = samples[("auto", temperature, "none", 0)]
    reference = samples[("reference", temperature, "none")]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, LONGEST - 1), _pairs(reference, LONGEST - 1))
    assert first > AUTO_THRESHOLD and last > AUTO_THRESHOLD, (first, last)


def test_model_free_proposals_are_point_masses(samples):
    """Proposals that come without q (an n-gram style proposer) are verified as point masses."""
    spec = samples[("point_mass", 1.0, "none", 3)]
    reference = samples[("reference", 1.0, "none")]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, 4), _pairs(reference, 4))
    assert first > THRESHOLD and last > THRESHOLD, (first, last)


def test_suffix_drafting_keeps_the_distribution(samples):
    """Suffix drafting's guesses (draft_service/suffix.py: from the row's own tokens and from the
    outputs of the rows that finished before it, 64 rows at a time) keep the target's distribution."""
    spec = samples[("suffix", 1.0, "none", 3)]
    reference = samples[("reference", 1.0, "none")]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, 4), _pairs(reference, 4))
    assert first > THRESHOLD and last > THRESHOLD, (first, last)


def test_a_draft_over_a_vocabulary_subset_keeps_the_distribution(samples):
    """A draft whose q covers 18 of the 32 tokens (and none of the others) is verified exactly too."""
    spec = samples[("vocab_subset", 1.0, "none", 3)]
    reference = samples[("reference", 1.0, "none")]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, 4), _pairs(reference, 4))
    assert first > THRESHOLD and last > THRESHOLD, (first, last)


def test_a_feature_draft_keeps_the_distribution(samples):
    """A feature draft (a head over the target's features, the default pair's kind) guessing over 24
    of the 32 tokens: its q, drawn in the draft with the target's features, is verified exactly too."""
    spec = samples[("feature", 1.0, "none", 3)]
    reference = samples[("reference", 1.0, "none")]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, 4), _pairs(reference, 4))
    assert first > THRESHOLD and last > THRESHOLD, (first, last)


@pytest.mark.parametrize(("temperature", "filter_name"), TREES)
def test_sampled_trees_keep_the_distribution(samples, temperature, filter_name):
    """Rows that propose trees (the draft's chain of 3 and its next draws beside it, verified by
    recursive rejection): the first pair, the last pair (t4, t5) and whole 3-token sequences."""
    spec = samples[("tree", temperature, filter_name, 3)]
    reference = samples[("reference", temperature, filter_name)]
    first = two_sample_p_value(_pairs(spec, 1), _pairs(reference, 1))
    last = two_sample_p_value(_pairs(spec, 4), _pairs(reference, 4))
    triples = two_sample_p_value(Counter(tuple(seq[:3]) for seq in spec), Counter(tuple(seq[:3]) for seq in reference))
    assert first > THRESHOLD and last > THRESHOLD and triples > THRESHOLD, (first, last, triples)


def test_the_test_catches_a_wrong_residual(samples):
    """Sampling from p instead of the residual after a rejection must fail the same comparison."""
    broken = samples[("wrong_residual", 1.0, "none", 1)]
    reference = samples[("reference", 1.0, "none")]
    assert two_sample_p_value(_pairs(broken, 2), _pairs(reference, 2)) < THRESHOLD


@pytest.mark.parametrize("filter_name", FILTERS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_target_sampling_matches_the_processed_distribution(samples, sampling_pair, temperature, filter_name):
    """The reference itself: the first token of target-only sampling against p computed directly."""
    from kernels.processing import process_logits
    from specstream.data.sampling import SamplingParams
    from specstream.models.loader import load_model

    model = load_model(sampling_pair["target"])
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]), model.new_cache(1, 16), torch.tensor([0]), torch.tensor([0]))
    params = SamplingParams(temperature=temperature, **FILTERS[filter_name])
    probs = process_logits(logits[:, -1], params)[0].double().tolist()
    observed = Counter(seq[0] for seq in samples[("reference", temperature, filter_name)])
    assert goodness_of_fit_p_value(observed, probs) > THRESHOLD
