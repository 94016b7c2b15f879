"""Every Triton kernel against its torch reference: odd shapes, half precision, ties, -inf entries,
all-masked rows; and the sampling kernels' distributions.

On a machine without a GPU the kernels run in Triton's CPU interpreter (conftest sets
TRITON_INTERPRET=1 before Triton is imported); with one, on CUDA. Failures print the largest
absolute and relative differences.

False-alarm rate of the distribution tests: each is a chi-square test failing at p < 1e-4; this
file makes 8 of them (3 sampler, 1 uniforms, 3 verification, 1 engine), so exact kernels fail
one with probability at most 8e-4 over the choice of keys. The keys are fixed, so the outcome is deterministic; `test_the_race_test_catches_a_biased_sampler`
shows the same test rejects a sampler that is off by a little.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tests.support.chi_square import goodness_of_fit_p_value

from kernels.argmax import best_token, best_token_reference
from kernels.cuts import cut_thresholds, cut_thresholds_reference
from kernels.dispatch import use
from kernels.lm_head import Hidden, OutputHead, lm_head, scores_reference
from kernels.logprobs import token_logprobs, token_logprobs_reference
from kernels.nbest import topk_logprobs, topk_logprobs_reference
from kernels.processing import process_logits, truncate
from kernels.random import ACCEPT, SAMPLE, row_keys, uniform_table, uniforms
from kernels.sample import sample, sample_reference
from kernels.speculative import speculative_verify_fused, speculative_verify_fused_reference
from kernels.verify import greedy_verify, greedy_verify_reference
from specstream.data.sampling import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Row-pass tiles are 512 ids (kernels/row_pass.py): 5 and 123 fit one tile, 4097 ends on a one-id
# tail, 49152 (SmolLM2's vocabulary) is 96 whole tiles. A 32,000 (Llama's, 62.5 tiles) added only
# another tail, at ~35 s of interpreted kernels a run.
VOCABS = (5, 123, 4097, 49152)
ROWS = (1, 7, 64)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
THRESHOLD = 1e-4


def _differences(got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = got.double().cpu(), want.double().cpu()
    finite = torch.isfinite(want) & torch.isfinite(got)
    if not finite.any():
        return "no finite pairs"
    diff = (got - want)[finite].abs()
    rel = diff / want[finite].abs().clamp(min=1e-30)
    return f"max abs diff {diff.max().item():.3g}, max rel diff {rel.max().item():.3g}"


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got.cpu() != want.cpu()).nonzero().flatten().tolist()
    assert not bad, f"{what}: rows {bad[:10]} differ ({_differences(got, want)})"


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    same_inf = (torch.isinf(got) == torch.isinf(want)).all() and (got[torch.isinf(got)] == want[torch.isinf(want)]).all()
    assert same_inf, f"{what}: -inf/inf in different places"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=atol, rtol=rtol), f"{what}: {_differences(got, want)}"


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] of `dtype` with a tie for the maximum (row 0), -inf entries (every row past
    the first, ~10%) and, from 7 rows on, an all -inf row (the last)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    if vocab >= 3:
        logits[0, vocab // 3] = logits[0, 2 * vocab // 3] = 20.0  # two maxima: the lower id must win
    if rows > 1:
        masked = torch.rand(rows - 1, vocab, generator=gen) < 0.1
        logits[1:][masked] = float("-inf")
    if rows >= 7:
        logits[-1] = float("-inf")
    return logits.to(DEVICE)


# ----- fused 1-best ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_best_token_matches_its_reference(vocab, rows, dtype):
    logits = _logits(rows, vocab, dtype)
    with use("triton"):
        ids, logprob = best_token(logits, logprob=True)
    want_ids, want_logprob = best_token_reference(logits, logprob=True)
    _assert_same(ids, want_ids, "argmax")
    assert want_ids.tolist() == torch.argmax(logits.float(), dim=-1).tolist()  # the reference is torch's argmax
    if vocab >= 3:
        assert int(ids[0]) == vocab // 3  # the lower of two tied ids
    if rows >= 7:
        assert int(ids[-1]) == 0 and logprob[-1].item() == float("-inf")  # all-masked row
    _assert_close(logprob, want_logprob, "log-probability", atol=1e-5, rtol=1e-5)


# ----- fused LM head ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", (5, 123, 4097))
def test_fused_head_computes_the_heads_logits(vocab, dtype):
    gen = torch.Generator().manual_seed(1)
    head = OutputHead((torch.randn(vocab, 72, generator=gen) * 0.2).to(dtype).to(DEVICE),
                      bias=(torch.randn(vocab, generator=gen)).to(dtype).to(DEVICE))
    hidden = Hidden(torch.randn(7, 72, generator=gen).to(dtype).to(DEVICE), head)
    with use("triton"):
        tiles = lm_head(hidden)
    want = scores_reference(hidden)
    # float32 sums in another order, then rounded to the head's dtype: one unit in its last place.
    rtol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    _assert_close(tiles, want, "fused head logits", atol=1e-4, rtol=rtol)


@pytest.mark.parametrize("vocab", (123, 4097))
def test_ops_read_hidden_states_as_they_read_logits(vocab):
    """Each op through the fused head gives what it gives on the logits the head computes (float32)."""
    gen = torch.Generator().manual_seed(2)
    head = OutputHead((torch.randn(vocab, 48, generator=gen) * 0.3).to(DEVICE))
    states = torch.randn(12, 48, generator=gen).to(DEVICE)
    hidden, logits = Hidden(states, head), head.logits(states)
    keys = row_keys(range(12), [3] * 12, SAMPLE, DEVICE)
    temperature = torch.full((12,), 0.9, device=DEVICE)
    draft = logits.view(4, 3, vocab).argmax(-1)[:, :2].clone()
    draft[1, 0] = (draft[1, 0] + 1) % vocab
    num_draft = torch.tensor([2, 2, 1, 0], device=DEVICE)
    with use("triton"):
        _assert_same(best_token(hidden)[0], best_token(logits)[0], "argmax")
        _assert_same(sample(hidden, temperature, keys), sample(logits, temperature, keys), "sample")
        for got, want in zip(greedy_verify(draft, num_draft, hidden),
                             greedy_verify(draft, num_draft, logits.view(4, 3, vocab))):
            _assert_same(got, want, "greedy verify")
        q_ids = torch.stack([draft, (draft + 1) % vocab], dim=-1)  # [4, 2, 2]
        q_probs = torch.tensor([0.6, 0.4], device=DEVICE).expand(4, 2, 2).contiguous()
        inputs = (q_ids, q_probs, draft, num_draft, temperature[:4], torch.full((4, 3), float("-inf"), device=DEVICE),
                  keys.view(4, 3), uniforms(range(4), [3] * 4, 2, ACCEPT, DEVICE))
        for got, want in zip(speculative_verify_fused(hidden, *inputs),
                             speculative_verify_fused(logits.view(4, 3, vocab), *inputs)):
            _assert_same(got, want, "speculative verify")


# ----- fused n-best ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_topk_logprobs_match_their_reference(vocab, rows, dtype):
    logits = _logits(rows, vocab, dtype, seed=6)
    k = min(vocab, 5)
    running = torch.linspace(-3.0, 0.0, rows, device=DEVICE)
    with use("triton"):
        values, ids = topk_logprobs(logits, k, running)
    want_values, want_ids = topk_logprobs_reference(logits, k, running)
    finite = torch.isfinite(want_values)
    _assert_same(ids[finite], want_ids[finite], "n-best ids")
    _assert_close(values, want_values, "n-best values", atol=1e-5, rtol=1e-5)
    if vocab >= 3:
        assert ids[0, :2].tolist() == [vocab // 3, 2 * vocab // 3]  # tied best: the lower id first
    want_lp = torch.log_softmax(logits.float(), dim=-1).gather(1, want_ids) + running[:, None]
    _assert_close(want_values[finite], want_lp[finite], "reference against log_softmax", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", (5, 123, 4097))
def test_token_logprobs_match_the_processed_distribution(vocab):
    """Log-probabilities of given tokens and the top alternatives under each row's processed
    distribution (greedy rows: the plain softmax), fused against process_logits."""
    logits = _logits(64, vocab, torch.float32, seed=11)[:-1]  # without the all-masked row
    # Greedy rows and sampled ones at temperatures where no kept token's probability underflows to
    # 0 in process_logits (at T = 0.05 it gives -inf where the exact value is finite).
    params = [SamplingParams() if i % 5 == 0 or p.temperature < 0.7 else p for i, p in enumerate(_sampling_rows(63))]
    tokens = torch.randint(0, vocab, (63,), generator=torch.Generator().manual_seed(12)).to(DEVICE)
    tokens[::3] = logits.argmax(-1)[::3]  # some rows ask for their most likely token
    n = min(vocab, 4)
    with use("triton"):
        chosen, top_ids, top_values = token_logprobs(logits, tokens, params, n)
    want_chosen, want_ids, want_values = token_logprobs_reference(logits, tokens, params, n)
    _assert_close(chosen, want_chosen, "chosen log-probability", atol=1e-4, rtol=1e-4)
    _assert_close(top_values, want_values, "top log-probabilities", atol=1e-4, rtol=1e-4)
    live = torch.isfinite(want_values)
    live[0] = False  # row 0's two tied maxima: torch.topk orders them either way
    _assert_same(top_ids[live], want_ids[live], "top ids")
    if vocab > 64:  # more alternatives than the fused window holds: the reference answers
        with use("triton"):
            _, wide_ids, wide_values = token_logprobs(logits[1:3], tokens[1:3], params[1:3], 70)
        assert wide_ids.shape == (2, 70)
        _assert_close(wide_values, token_logprobs_reference(logits[1:3], tokens[1:3], params[1:3], 70)[2],
                      "70 alternatives", atol=1e-6, rtol=1e-6)


def test_topk_logprobs_through_the_fused_head():
    gen = torch.Generator().manual_seed(7)
    head = OutputHead((torch.randn(4097, 40, generator=gen) * 0.3).to(DEVICE))
    states = torch.randn(9, 40, generator=gen).to(DEVICE)
    with use("triton"):
        values, ids = topk_logprobs(Hidden(states, head), 8)
    want_values, want_ids = topk_logprobs_reference(head.logits(states), 8)
    _assert_same(ids.flatten(), want_ids.flatten(), "n-best ids")
    _assert_close(values, want_values, "n-best values", atol=1e-4, rtol=1e-4)


# ----- fused sampling --------------------------------------------------------------------------

def _sampling_rows(rows: int) -> list[SamplingParams]:
    """Every combination of cuts, and temperatures from tiny to large."""
    temps = (0.05, 0.7, 1.0, 1.6)
    cuts = ({}, {"top_k": 3}, {"top_p": 0.8}, {"top_k": 40, "top_p": 0.5})
    return [SamplingParams(temperature=temps[i % 4], seed=i, **cuts[(i // 4) % 4]) for i in range(rows)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_matches_its_reference(vocab, rows, dtype):
    logits = _logits(rows, vocab, dtype, seed=3)
    params = _sampling_rows(rows)
    temperature = torch.tensor([p.temperature for p in params], device=DEVICE)
    keys = row_keys([p.seed for p in params], [11] * rows, SAMPLE, DEVICE)
    threshold = cut_thresholds(logits.float(), params)
    with use("triton"):
        ids = sample(logits, temperature, keys, threshold)
    _assert_same(ids, sample_reference(logits, temperature, keys, threshold), "sample")
    kept = logits.float().gather(1, ids[:, None]).squeeze(1) >= threshold
    live = torch.isfinite(logits.float()).any(dim=1)
    assert (kept | ~live).all(), "a token the cuts removed was drawn"


def test_cut_thresholds_keep_what_process_logits_keeps():
    logits = _logits(64, 4097, torch.float32, seed=4)[:-1]  # without the all-masked row
    params = _sampling_rows(63)
    threshold = cut_thresholds(logits, params)
    kept = (logits >= threshold[:, None]) & torch.isfinite(logits)
    want = process_logits(logits, params) > 0
    # Rows with cuts, at temperatures where no kept token's probability underflows to 0.
    rows = [b for b, p in enumerate(params) if (p.top_k or p.top_p < 1.0) and p.temperature >= 0.7]
    assert len(rows) >= 20
    differ = [b for b in rows if (kept[b] != want[b]).any()]
    assert not differ, f"rows {differ}: the cut keeps other tokens than process_logits"


@pytest.mark.parametrize("vocab", (5, 123, 4097, 49152))
def test_fused_cut_thresholds_equal_the_reference(vocab, monkeypatch):
    """Thresholds read off the fused n-best pass, logits or hidden states, equal the torch ones;
    rows the 64 largest scores do not settle (a flat nucleus, an all-masked row) take the fallback."""
    import sys

    module = sys.modules["kernels.cuts"]
    fallback_rows: list[int] = []

    def counted(logits, params):
        fallback_rows.append(len(params))
        return cut_thresholds_reference(logits, params)

    # Every combination of temperature and cuts (_sampling_rows) twice; once at the real vocabulary's
    # size, where each row's interpreted passes take ~1 s (37 s at 32 rows).
    rows = 16 if vocab > 4097 else 32
    logits = _logits(rows, vocab, torch.float32, seed=8)
    params = _sampling_rows(rows)
    want = cut_thresholds_reference(logits, params)
    monkeypatch.setattr(module, "cut_thresholds_reference", counted)
    with use("triton"):
        got = cut_thresholds(logits, params)
    _assert_same(got, want, "threshold")
    assert 0 < sum(fallback_rows) < rows  # both ways were taken
    gen = torch.Generator().manual_seed(9)
    if vocab > 4097:  # from hidden states, one row per kind of cut (and four temperatures): ~1 s a row
        params = params[::5]
    head = OutputHead((torch.randn(vocab, 40, generator=gen) * 0.5).to(DEVICE))
    hidden = Hidden(torch.randn(len(params), 40, generator=gen).to(DEVICE), head)
    with use("triton"):
        got = cut_thresholds(hidden, params)
        tiles = lm_head(hidden)  # the logits as the fused head computes them (float32 sums in its order)
    # A threshold is one of the row's scores. In the interpreter a tile's dot products are a numpy
    # matmul, whose float32 sums BLAS orders by the tile's shape (and by the CPU's vector width), and
    # the n-best pass's tiles are not lm_head's: the two scores of a token differ by up to the
    # bound of two summation orders (within a unit in the last place with AVX-512 BLAS here).
    want = cut_thresholds_reference(tiles, params)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), _differences(got, want)  # no cut in the same rows
    assert ((got - want)[finite].abs() <= _orders_bound(hidden)[finite]).all(), _differences(got, want)


def _orders_bound(hidden: Hidden) -> torch.Tensor:
    """[rows]: how far two float32 sums of a row's score, in different orders, can differ at most:
    2 K u max over the row's tokens of sum_k |h_k w_k| (K products, u = 2^-24 each way)."""
    states, weight = hidden.states.double().abs(), hidden.head.weight.double().abs()
    return (2 * states.shape[-1] * 2.0**-24 * (states @ weight.T).max(dim=-1).values).float()  # [rows]


def _race_counts(logits: torch.Tensor, params: SamplingParams, draws: int, sampler=None) -> Counter:
    sampler = sampler or sample
    rows = logits[None].expand(draws, -1).contiguous()
    threshold = cut_thresholds(logits[None], [params]).expand(draws)
    keys = row_keys([params.seed] * draws, range(draws), SAMPLE, DEVICE)
    with use("triton"):
        ids = sampler(rows, torch.full((draws,), params.temperature, device=DEVICE), keys, threshold)
    return Counter(ids.tolist())


@pytest.mark.parametrize("cuts", [{}, {"top_k": 7}, {"top_p": 0.85}], ids=["none", "top_k", "top_p"])
def test_sampled_tokens_follow_the_processed_distribution(cuts):
    logits = (torch.randn(1, 60, generator=torch.Generator().manual_seed(5)) * 2).to(DEVICE)[0]
    params = SamplingParams(temperature=0.8, seed=17, **cuts)
    probs = process_logits(logits[None], params)[0].double().cpu().tolist()
    assert goodness_of_fit_p_value(_race_counts(logits, params, 20_000), probs) > THRESHOLD


def test_the_race_test_catches_a_biased_sampler():
    """A sampler whose temperature is 5% off (the kind of slip a kernel makes) fails the same test."""
    logits = (torch.randn(1, 60, generator=torch.Generator().manual_seed(5)) * 2).to(DEVICE)[0]
    params = SamplingParams(temperature=0.8, seed=17)
    probs = process_logits(logits[None], params)[0].double().cpu().tolist()

    def off(scores, temperature, keys, threshold):
        return sample(scores, temperature * 1.05, keys, threshold)

    assert goodness_of_fit_p_value(_race_counts(logits, params, 20_000, off), probs) < THRESHOLD


def test_uniforms_are_the_same_bits_in_kernels_and_torch_and_look_uniform():
    keys = row_keys(range(4), [0, 1, 2, 3], SAMPLE)
    u = uniform_table(keys, torch.arange(50_000))  # [4, 50000]
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    counts = Counter((u.flatten() * 20).long().tolist())
    assert goodness_of_fit_p_value(counts, [0.05] * 20) > THRESHOLD
    # the kernels' draws are these: a race over one-hot scores picks ids in the order of their u
    logits = torch.zeros(4, 50, device=DEVICE)
    with use("triton"):
        ids = sample(logits, torch.ones(4, device=DEVICE), keys.to(DEVICE))
    _assert_same(ids.cpu(), (-torch.log(-torch.log(uniform_table(keys, torch.arange(50))))).argmax(dim=1), "race")


# ----- verification ----------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", (0, 1, 4, 15))
@pytest.mark.parametrize("vocab", (5, 4097, 49152))
def test_greedy_verify_matches_its_reference(vocab, gamma):
    gen = torch.Generator().manual_seed(gamma)
    batch = 7
    logits = (torch.randn(batch, gamma + 1, vocab, generator=gen) * 3).to(DEVICE)
    logits[0, 0, :] = float("-inf")  # an all-masked row: argmax 0, as torch
    target = logits.argmax(-1)
    draft = target[:, :gamma].clone()
    if gamma:
        draft[1, gamma // 2] = (draft[1, gamma // 2] + 1) % vocab  # a miss in the middle
        draft[2, 0] = (draft[2, 0] + 1) % vocab  # a miss at once
    num_draft = torch.tensor([gamma, gamma, gamma, max(gamma - 1, 0), 0, gamma, gamma], device=DEVICE)
    with use("triton"):
        accepted, tokens = greedy_verify(draft.to(DEVICE), num_draft, logits)
    want_accepted, want_tokens = greedy_verify_reference(draft, num_draft, logits)
    _assert_same(accepted, want_accepted, "accepted")
    _assert_same(tokens.flatten(), want_tokens.flatten(), "tokens")
    if gamma:
        assert int(accepted[1]) == gamma // 2 and int(accepted[2]) == 0  # the test reaches both misses


def _speculative_case(batch: int, gamma: int, vocab: int, width: int, seed: int, temperature: float = 1.0,
                      cuts: dict | None = None):
    """Target logits, a draft that disagrees with them in structured ways and its sparse q, with
    one proposal outside its own q (verified as a point mass) and varied proposal counts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, gamma + 1, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=temperature, **(cuts or {}))
    q_full = process_logits(logits[:, :gamma] + torch.randn(batch, gamma, vocab, generator=gen) * 0.8, params)
    q_ids, q_probs = truncate(q_full, width)  # [B, G, K]
    pick = torch.multinomial(q_probs.reshape(-1, q_probs.shape[-1]) + 1e-12, 1, generator=gen).view(batch, gamma)
    draft = q_ids.gather(-1, pick[..., None]).squeeze(-1)
    if gamma and batch > 1:
        q_probs[1, 0] = 0.0  # a proposal its own q rules out: verified as a point mass
        q_probs[1, 0, 0] = 1.0
        draft[1, 0] = q_ids[1, 0, -1] if width > 1 else (q_ids[1, 0, 0] + 1) % vocab
    num_draft = torch.randint(0, gamma + 1, (batch,), generator=gen)
    return logits, params, q_ids, q_probs, draft, num_draft


def _verify_inputs(logits, params, gamma, seeds, position=0):
    batch = logits.shape[0]
    threshold = cut_thresholds(logits.reshape(-1, logits.shape[-1]), [params] * (batch * (gamma + 1)))
    keys = torch.stack([row_keys(seeds, [position + j] * batch, SAMPLE) for j in range(gamma + 1)], dim=1)
    u_accept = uniforms(seeds, [position] * batch, gamma, ACCEPT)
    return torch.full((batch,), params.temperature), threshold.view(batch, gamma + 1), keys, u_accept


@pytest.mark.parametrize("cuts", [{}, {"top_k": 20}, {"top_p": 0.9}], ids=["none", "top_k", "top_p"])
@pytest.mark.parametrize("gamma", (0, 1, 4))
@pytest.mark.parametrize("vocab", (5, 123, 4097))
def test_speculative_verify_matches_its_reference(vocab, gamma, cuts):
    logits, params, q_ids, q_probs, draft, num_draft = _speculative_case(16, gamma, vocab, min(8, vocab), seed=vocab + gamma,
                                                                         temperature=0.9, cuts=cuts)
    inputs = _verify_inputs(logits, params, gamma, list(range(16)))
    args = (q_ids, q_probs, draft, num_draft, *inputs)
    with use("triton"):
        accepted, emitted = speculative_verify_fused(logits.to(DEVICE), *(a.to(DEVICE) for a in args))
    want_accepted, want_emitted = speculative_verify_fused_reference(logits, *args)
    _assert_same(accepted, want_accepted, "accepted")
    _assert_same(emitted, want_emitted, "emitted")
    assert (accepted.cpu() <= num_draft).all()


def test_speculative_verify_keeps_the_target_distribution():
    """One row, γ = 3, drawn 20,000 times with fresh keys: the accepted-count distribution is
    [1 - a0, a0 (1 - a1), a0 a1 (1 - a2), a0 a1 a2] with a_i the acceptance at depth i (exact here:
    the proposals are fixed, so a_i = min(1, p_i(x_i) / q_i(x_i))), and the emitted token after a
    rejection at depth 0 follows norm(max(0, p_0 - q_0))."""
    gamma, vocab, draws = 3, 30, 20_000
    gen = torch.Generator().manual_seed(9)
    row_logits = torch.randn(gamma + 1, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    p = process_logits(row_logits[None], params)[0].double()  # [G+1, V]
    q = process_logits((row_logits[:gamma] + torch.randn(gamma, vocab, generator=gen))[None], params)[0]
    q_ids, q_probs = truncate(q, vocab)  # full support
    draft = q_ids[:, 0]  # each depth proposes its q's most likely token
    logits = row_logits[None].expand(draws, -1, -1).contiguous()
    seeds = list(range(draws))
    inputs = _verify_inputs(logits, params, gamma, seeds)
    args = (q_ids[None].expand(draws, -1, -1), q_probs[None].expand(draws, -1, -1),
            draft[None].expand(draws, -1), torch.full((draws,), gamma))
    # The kernel runs one program per sequence, which the CPU interpreter walks one by one: it is
    # checked token for token against its reference on the first draws, and the reference's
    # 20,000 draws carry the statistics (on CUDA the kernel draws them all).
    checked = draws if DEVICE == "cuda" else 300
    with use("triton"):
        accepted, emitted = speculative_verify_fused(logits[:checked].to(DEVICE),
                                                     *(a[:checked].to(DEVICE) for a in (*args, *inputs)))
    want_accepted, want_emitted = speculative_verify_fused_reference(logits, *args, *inputs)
    _assert_same(accepted.cpu(), want_accepted[:checked], "accepted")
    _assert_same(emitted.cpu(), want_emitted[:checked], "emitted")
    accepted, emitted = want_accepted, want_emitted
    qd = q.double()
    a = [min(1.0, float(p[i, draft[i]] / qd[i, draft[i]])) for i in range(gamma)]
    expected = [1 - a[0], a[0] * (1 - a[1]), a[0] * a[1] * (1 - a[2]), a[0] * a[1] * a[2]]
    assert goodness_of_fit_p_value(Counter(accepted.tolist()), expected) > THRESHOLD
    residual = (p[0] - qd[0]).clamp(min=0)
    residual = (residual / residual.sum()).tolist()
    first_rejected = Counter(emitted[accepted == 0].tolist())
    assert sum(first_rejected.values()) > 1000 and goodness_of_fit_p_value(first_rejected, residual) > THRESHOLD
    bonus = Counter(emitted[accepted == gamma].tolist())  # all three accepted: the bonus follows p_3
    assert sum(bonus.values()) > 1000 and goodness_of_fit_p_value(bonus, p[gamma].tolist()) > THRESHOLD


# ----- the engine through both backends ---------------------------------------------------------

@pytest.mark.parametrize("gamma", (0, 3, None), ids=("off", "fixed-3", "auto"))
def test_the_engine_decodes_the_same_greedy_tokens_through_triton_and_torch(model_zoo, gamma):
    from tests.support.engine_harness import naive_greedy, run_engine

    prompts = [[5, 9, 17, 3], [200, 1, 1, 1, 44, 7], [7] * 20]
    with use("torch"):
        torch_tokens, _ = run_engine(model_zoo["target"], model_zoo["partial"], prompts, gamma, 12, device=DEVICE)
    with use("triton"):
        triton_tokens, finals = run_engine(model_zoo["target"], model_zoo["partial"], prompts, gamma, 12, device=DEVICE)
    assert triton_tokens == torch_tokens
    assert triton_tokens == [naive_greedy(model_zoo["target"], p, 12, device=DEVICE) for p in prompts]
    if gamma:
        assert sum(f.stats.accepted_tokens for f in finals) > 0  # speculation ran and was verified by the kernel


def test_the_engine_samples_the_same_distribution_through_triton_and_torch(sampling_pair):
    """Tokens 2 and 3 of each generation (settled by speculative steps at γ = 3: acceptance,
    residual and bonus draws) through the Triton kernels and through the torch ops, other seeds:
    a two-sample chi-square test (p < 1e-4 fails; counted in the module's false-alarm rate)."""
    from tests.support.chi_square import two_sample_p_value
    from tests.support.engine_harness import run_engine

    draws, prompt = 1000, [5, 9, 17, 3, 22]

    def pairs(seed0: int) -> Counter:
        params = [SamplingParams(temperature=1.0, top_k=8 if i % 2 else 0, seed=seed0 + i) for i in range(draws)]
        tokens, _ = run_engine(sampling_pair["target"], sampling_pair["draft"], [prompt] * draws, 3, 3,
                               max_slots=64, sampling=params, device=DEVICE)
        return Counter((t[1], t[2]) for t in tokens)

    with use("triton"):
        through_triton = pairs(0)
    with use("torch"):
        through_torch = pairs(1 << 40)
    assert two_sample_p_value(through_triton, through_torch) > THRESHOLD


def test_coupled_speculative_sampling_through_the_kernels_is_plain_sampling(sampling_pair):
    """Coupled verification on the Triton backend (the fused sampler at every position of the
    window, the draft's q from the fused n-best pass): the plain sampled tokens, token for token."""
    from tests.support.engine_harness import run_engine

    prompt = [5, 9, 17, 3, 22]
    params = [SamplingParams(temperature=1.0, top_k=8 if i % 2 else 0, seed=70 + i) for i in range(6)]
    with use("triton"):
        plain, _ = run_engine(sampling_pair["target"], None, [prompt] * 6, 0, 8, sampling=params, device=DEVICE)
        spec, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], [prompt] * 6, 3, 8, sampling=params,
                                  config={"speculative_sampling": "coupled"}, device=DEVICE)
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0


def test_the_drafts_truncated_q_from_the_kernels_is_the_torch_one():
    """A draft's sampling rows on the Triton backend: q = the K most likely tokens after the cuts,
    renormalised, from the fused n-best pass; the same table the torch path sends."""
    from draft_service.proposer import _truncated_q

    gen = torch.Generator().manual_seed(10)
    head = OutputHead((torch.randn(4097, 40, generator=gen) * 0.5).to(DEVICE))
    hidden = Hidden(torch.randn(32, 40, generator=gen).to(DEVICE), head)
    params = [p for p in _sampling_rows(32) if p.temperature >= 0.7]
    hidden = Hidden(hidden.states[: len(params)], head)
    with use("triton"):
        ids, q = _truncated_q(hidden, params, 16)
        logits = lm_head(hidden)
    want_ids, want_q = truncate(process_logits(logits, params), 16)
    # The kernel's scores and lm_head's differ by up to the bound of two summation orders
    # (_orders_bound); a token whose score lies that close to its row's cut may be kept by one and
    # cut by the other, and then each renormalises over its own set. Rows with no such flip must
    # agree; a flipped token must lie at the cut; over the tokens both keep, q agrees renormalised.
    bound = _orders_bound(hidden)
    threshold = cut_thresholds_reference(logits, params)  # [rows]
    flipped = 0
    for r in range(len(params)):
        got_ids, ref_ids = set(ids[r][q[r] > 0].tolist()), set(want_ids[r][want_q[r] > 0].tolist())
        both = sorted(got_ids & ref_ids)
        for token in got_ids ^ ref_ids:
            flipped += 1
            assert abs(logits[r, token] - threshold[r]) <= 2 * bound[r], (r, token)
        kept, ref_kept = torch.isin(ids[r], torch.tensor(both)), torch.isin(want_ids[r], torch.tensor(both))
        _assert_same(ids[r][kept], want_ids[r][ref_kept], f"q ids, row {r}")
        mine, ref = q[r][kept], want_q[r][ref_kept]
        _assert_close(mine / mine.sum(), ref / ref.sum(), f"q, row {r}", atol=1e-6, rtol=1e-5)
    assert flipped <= 2  # a near-tie at a cut is rare: not a way around the check


def test_the_engine_reports_the_same_logprobs_through_triton_and_torch(sampling_pair):
    from tests.support.engine_harness import run_engine

    prompts = [[5, 9, 17, 3], [1, 2, 3]]
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, top_k=6, seed=4)]
    runs = {}
    for name in ("torch", "triton"):
        with use(name):
            runs[name] = run_engine(sampling_pair["target"], sampling_pair["draft"], prompts, 3, 6,
                                    sampling=sampling, logprobs=3, device=DEVICE)
    (torch_tokens, torch_finals), (triton_tokens, triton_finals) = runs["torch"], runs["triton"]
    assert triton_tokens[0] == torch_tokens[0]  # greedy: the same tokens (the sampled row may differ)
    for b in range(2):
        for got, want, token in zip(triton_finals[b].logprobs, torch_finals[b].logprobs, triton_tokens[b]):
            assert got.token_id == token
            if b == 0:  # same token, same distribution: same numbers
                assert abs(got.logprob - want.logprob) < 1e-4
                assert [t for t, _ in got.top] == [t for t, _ in want.top]
            assert len(got.top) == 3 and all(v <= 0 for _, v in got.top)
