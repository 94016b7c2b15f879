"""Sampling math: logits processing, counter-based uniforms, the race sampler, and speculative-
sampling verification.

The central property (docs/architecture.md §7.1, Leviathan et al. Thm 3.5): one speculative step emits a token
distributed exactly as p, whatever q is: min(p, q) + (1 - sum min(p, q)) * norm(max(0, p - q)) = p.
Checked on the implementation itself (the acceptance half, `speculative_accept`, which returns the
distribution the emitted token is drawn from), for hypothesis-generated p and q including disjoint
supports and q with zeros where p is large: the acceptance probability is probed at its boundary
and the emitted distribution enumerated exactly. The race that draws from that distribution is
checked statistically (chi-square, p > 1e-3: a false alarm once in a thousand seed choices; the
seeds are fixed, so CI never flakes).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from tests.support.chi_square import goodness_of_fit_p_value
from tests.support.verify_oracle import speculative_verify_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.processing import process_logits, truncate
import kernels.random as random_ops
from kernels import native
from kernels.random import ACCEPT, RESIDUAL, SAMPLE, gumbel, race, row_keys, uniform, uniform_table, uniforms
from kernels.speculative import _normalise, speculative_accept, speculative_verify
from specstream.data.sampling import SamplingParams

THRESHOLD = 1e-3


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def _accept_one(p_step: torch.Tensor, p_next: torch.Tensor, q: torch.Tensor, x: int, u_accept: float
                ) -> tuple[int, torch.Tensor]:
    """One γ = 1 step through `speculative_accept`: (accepted, the distribution the emitted token
    is drawn from, normalised)."""
    vocab = p_step.shape[0]
    p = torch.stack([p_step, p_next])[None]  # [1, 2, V]
    ids = torch.arange(vocab)[None, None]  # [1, 1, V]: q travels as (all ids, probs)
    accepted, dist = speculative_accept(p, ids, q[None, None], torch.tensor([[x]]), torch.tensor([1]),
                                        torch.tensor([[u_accept]], dtype=torch.float64))
    return int(accepted[0]), dist[0] / dist[0].sum()


def _emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(first emitted token = y) of one γ = 1 step, enumerating x ~ q, the acceptance draw (probed
    at the implementation's own threshold) and the distribution it then emits from."""
    vocab = p.shape[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    for x in range(vocab):
        if q[x] <= 0:
            continue
        a = min(1.0, float(p[x] / q[x]))
        if a > 1 - 1e-9:
            a = 1.0  # p(x) = q(x) up to rounding: no uniform below 1 can probe the boundary
        # The implementation must accept exactly when u < min(1, p/q).
        if a > 0:
            assert _accept_one(p, p, q, x, a * (1 - 1e-9))[0] == 1
        if a < 1:
            assert _accept_one(p, p, q, x, min(a * (1 + 1e-9) + 1e-12, 1 - 1e-12))[0] == 0
        out[x] += q[x] * a
        if a < 1:
            accepted, residual = _accept_one(p, p, q, x, 1 - 1e-12)
            assert accepted == 0
            out += q[x] * (1 - a) * residual
    return out


# Masses below 1e-6 become exact zeros: an acceptance probability of 5e-324 cannot be probed with a
# uniform just below it (it rounds to the same subnormal), and such mass is never observable.
probabilities = st.lists(st.floats(min_value=0.0, max_value=1.0).map(lambda v: 0.0 if v < 1e-6 else v),
                         min_size=2, max_size=6)


@settings(max_examples=40, deadline=None, derandomize=True)  # deterministic: CI never flakes
@given(probabilities, probabilities, st.data())
def test_one_step_emits_exactly_p(p_raw, q_raw, data):
    vocab = min(len(p_raw), len(q_raw))
    p_raw, q_raw = p_raw[:vocab], q_raw[:vocab]
    if sum(p_raw) <= 1e-6 or sum(q_raw) <= 1e-6:
        p_raw = [1.0] + p_raw[1:]
        q_raw = q_raw[:-1] + [1.0]
    if data.draw(st.booleans()):  # q gives no mass where p is largest
        q_raw[max(range(vocab), key=lambda i: p_raw[i])] = 0.0
        if sum(q_raw) == 0:
            q_raw[min(range(vocab), key=lambda i: p_raw[i])] = 1.0
    p, q = _dist(p_raw), _dist(q_raw)
    got = _emitted_distribution(p, q)
    assert torch.allclose(got, p, atol=1e-9), (got.tolist(), p.tolist())


def test_disjoint_supports_always_reject_and_emit_p():
    p, q = _dist([0.5, 0.5, 0, 0]), _dist([0, 0, 0.3, 0.7])
    assert torch.allclose(_emitted_distribution(p, q), p, atol=1e-9)
    assert _accept_one(p, p, q, 2, 0.0)[0] == 0  # even u = 0 cannot accept a token p rules out


def test_identical_distributions_always_accept():
    p = _dist([0.1, 0.2, 0.7])
    for x in range(3):
        assert _accept_one(p, p, p, x, 1 - 1e-12)[0] == 1


def test_a_proposal_its_q_rules_out_is_verified_as_a_point_mass():
    """A draft bug (x with q(x) = 0) must not bias the output: x is accepted with p(x), and a
    rejection samples p without x, which is exact however x was chosen."""
    p, q = _dist([0.2, 0.5, 0.3]), _dist([1.0, 0.0, 0.0])
    assert _accept_one(p, p, q, 1, 0.49)[0] == 1 and _accept_one(p, p, q, 1, 0.51)[0] == 0  # P(accept) = p(x)
    _, residual = _accept_one(p, p, q, 1, 1 - 1e-12)
    emitted = 0.5 * residual
    emitted[1] += 0.5
    assert torch.allclose(emitted, p, atol=1e-9), emitted.tolist()


def test_bonus_token_comes_from_the_last_distribution():
    p_step, p_next = _dist([0.0, 1.0, 0.0]), _dist([0.0, 0.0, 1.0])
    accepted, dist = _accept_one(p_step, p_next, p_step, 1, 0.5)
    assert accepted == 1 and dist.tolist() == [0.0, 0.0, 1.0]
    emitted = speculative_verify(torch.stack([p_step, p_next])[None], torch.arange(3)[None, None], p_step[None, None],
                                 torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.5]], dtype=torch.float64),
                                 row_keys([1, 1], [4, 5], SAMPLE)[None])[1]
    assert emitted.tolist() == [2]


def test_the_race_samples_the_table_and_never_a_zero():
    """`race` (the torch path's sampler) against exact probabilities: 20,000 rows with their own
    keys; chi-square p > 1e-3. Tokens with no mass are never drawn."""
    probs = _dist([0.0, 0.05, 0.3, 0.0, 0.15, 0.5, 0.0])
    keys = row_keys([11] * 20_000, range(20_000), SAMPLE)
    drawn = race(probs.expand(20_000, -1), keys)
    assert goodness_of_fit_p_value(Counter(drawn.tolist()), probs.tolist()) > THRESHOLD
    assert race(probs.expand(3, -1) * 7.0, keys[:3]).tolist() == drawn[:3].tolist()  # scale does not matter
    # Columns may stand for any token ids: the noise follows the id, not the column.
    ids = torch.tensor([[5, 2, 4]])
    table = torch.tensor([[0.5, 0.3, 0.15]])
    assert int(ids[0, race(table, keys[:1], ids)[0]]) == int(race(probs[None], keys[:1])[0])


def test_a_tokens_noise_has_the_same_bits_wherever_it_is_computed():
    """What the support-only race rests on: the Gumbel noise of (key, token) does not depend on the
    length of the vector it is computed in or its place there (every length 1..300, and a whole
    49,152-token row, at random places)."""
    gen = torch.Generator().manual_seed(3)
    keys = row_keys(range(8), range(8), SAMPLE)  # [8]
    full = gumbel(keys, torch.arange(49152))  # [8, 49152]
    for length in range(1, 301):
        rows = torch.randint(0, 8, (length,), generator=gen)
        tokens = torch.randint(0, 49152, (length,), generator=gen)
        got = gumbel(keys[rows], tokens[:, None])[:, 0]  # [length]
        assert torch.equal(got, full[rows, tokens]), length


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_race_over_the_support_picks_the_dense_races_winner(rows):
    """A top-p or top-k table races over its support only: the same winner as racing every column,
    for supports of 1 to 2,000 tokens (most rows take the support path, which is checked), ids
    given or not, rows without mass included; a table with wide support takes the dense path."""
    gen = torch.Generator().manual_seed(rows)
    vocab = 49152
    for trial in range(40):
        probs = torch.zeros(rows, vocab)
        for r in range(rows):
            if trial % 10 == 9 and r == 0:
                continue  # a row without mass: column 0, as the dense race gives it
            width = int(torch.randint(1, 2000 // rows + 2, (1,), generator=gen))
            cols = torch.randperm(vocab, generator=gen)[:width]
            probs[r, cols] = torch.rand(width, generator=gen) ** 4 + 1e-30
        keys = row_keys([trial] * rows, range(rows), SAMPLE)
        ids = torch.randperm(vocab, generator=gen).expand(rows, -1) if trial % 2 else torch.arange(vocab)
        sparse = random_ops._race_support(probs, keys, ids)
        assert sparse is not None
        assert torch.equal(sparse, random_ops._race_dense(probs, keys, ids)), trial
        assert torch.equal(race(probs, keys, ids), sparse)
    wide = torch.rand(rows, vocab, generator=gen)
    assert random_ops._race_support(wide, row_keys([1] * rows, range(rows), SAMPLE), torch.arange(vocab)) is None


def _tied_pair(key: torch.Tensor, vocab: int) -> tuple[int, int]:
    """Two token ids whose uniforms under `key` are the same float (23-bit uniforms: a 49,152-token
    row holds ~140 such pairs)."""
    u = uniform_table(key, torch.arange(vocab))[0]  # [V]
    order = torch.argsort(u, stable=True)
    same = (u[order][1:] == u[order][:-1]).nonzero()[0, 0]
    a, b = sorted((int(order[same]), int(order[same + 1])))
    return a, b


@pytest.mark.parametrize("rows", [1, 4])
def test_the_native_race_picks_the_dense_races_winner(rows):
    """The native library's log-free bounds (`_race_candidates`) keep every column that can win,
    and its double-precision scores settle all but near-ties: the same winner as racing every
    column, bit for bit, over peaked, flat and hot tables,
    float32 and float64 (a residual), cut tables, masses down to 1e-300, rows without mass, and a
    tie (two columns with the same mass and the same uniform: the first wins); and tables whose
    columns carry their own token ids (a draft's truncated q). Every table takes the native path,
    which is checked."""
    assert native.library() is not None  # built by `make test` (tests/test_native_ops.py)
    gen = torch.Generator().manual_seed(rows)
    vocab = 49152
    for trial in range(60):
        scale = (0.2, 1.0, 3.0, 8.0)[trial % 4]
        probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)  # [N, V]
        if trial % 3 == 1:
            probs = probs.double()
        if trial % 5 == 2:
            probs = probs * (torch.rand(rows, vocab, generator=gen) > 0.9)  # a cut table
        if trial % 7 == 3:
            probs = probs.double() * 1e-300
        if trial % 10 == 9:
            probs[0] = 0.0  # a row without mass: column 0, as the dense race gives it
        keys = row_keys([trial] * rows, range(rows), SAMPLE)
        fast = random_ops._race_candidates(probs, keys)
        assert fast is not None
        assert torch.equal(fast, random_ops._race_dense(probs, keys, torch.arange(vocab))), trial
        assert torch.equal(race(probs, keys), fast)
        # A draft's sparse q: columns with their own token ids (64 or 256 of them, or an odd width).
        width = (64, 256, 100)[trial % 3]
        top, ids = torch.topk(probs.float(), width, dim=-1)  # [N, K]
        table = (top / top.sum(-1, keepdim=True).clamp(min=1e-30)).to(probs.dtype)
        sparse = random_ops._race_candidates(table, keys, ids)
        assert sparse is not None or width % 64  # an odd width scores a contested row densely
        assert torch.equal(race(table, keys, ids), random_ops._race_dense(table, keys, ids)), trial
    keys = row_keys(range(rows), range(rows), SAMPLE)
    probs = torch.zeros(rows, vocab)
    for r in range(rows):
        a, b = _tied_pair(keys[r : r + 1], vocab)
        probs[r, [a, b]] = 0.5
        probs[r, (a + 1) % vocab] = 1e-6  # a third column that cannot win
        assert int(race(probs[r : r + 1], keys[r : r + 1])[0]) == a
    winner, contested = native.library().race_candidates(probs, keys)
    assert winner.tolist() == [-1] * rows and contested.numel() == 2 * rows  # a tie is left to the torch ops
    assert torch.equal(race(probs, keys), random_ops._race_dense(probs, keys, torch.arange(vocab)))


def test_a_uniform_is_never_1_so_the_race_never_picks_a_token_without_mass():
    """Regression: with 24-bit uniforms (h + 0.5) / 2^24 rounded to 1.0 in float32 for the largest
    h, whose token then won any race with key +inf; (seed 9, position 42, SAMPLE) gave token 36253
    such a u. Now u <= 1 - 2^-24 and its noise is finite."""
    keys = row_keys([9], [42], SAMPLE)
    assert uniform_table(keys, torch.tensor([36253])).item() < 1.0
    assert torch.isfinite(gumbel(keys, torch.arange(49152))).all()
    probs = torch.full((1, 49152), 1e-12)
    probs[0, 7] = 1.0
    assert race(probs, keys).item() == 7
    every = uniform_table(row_keys(range(64), range(64), SAMPLE), torch.arange(49152))
    assert 0.0 < every.min().item() and every.max().item() < 1.0


def test_uniform_is_deterministic_in_range_and_keyed():
    draws = [uniform(7, pos, ACCEPT) for pos in range(20000)]
    assert draws == [uniform(7, pos, ACCEPT) for pos in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert uniform(7, 3, ACCEPT) != uniform(7, 3, SAMPLE) != uniform(8, 3, SAMPLE) != uniform(8, 3, RESIDUAL)
    # Kolmogorov-Smirnov against U(0, 1): the 1e-3 critical value is 1.95 / sqrt(n).
    draws.sort()
    ks = max(max((i + 1) / len(draws) - u, u - i / len(draws)) for i, u in enumerate(draws))
    assert ks < 1.95 / math.sqrt(len(draws)), ks


def _process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return process_logits(logits[None], params)[0]


def test_process_logits_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.5, -1.0])
    process = _process
    full = process(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(full, torch.softmax(logits, -1))
    hot = process(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    top2 = process(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and torch.allclose(top2[:2], torch.softmax(logits[:2], -1))
    top3_tied = process(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (top3_tied[:4] > 0).all() and top3_tied[4] == 0  # the tie at the boundary stays
    nucleus = process(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (nucleus[1:] == 0).all() and nucleus[0] == 1.0  # p(0) = 0.537 alone reaches 0.5
    nucleus2 = process(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert (nucleus2[:2] > 0).all() and (nucleus2[2:] == 0).all()
    assert torch.allclose(nucleus2.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(seed=-1), "seed=-1"),
    (dict(seed=1 << 64), "seed="),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_process_logits_applies_each_rows_own_settings():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50) * 3  # [B, positions, V]
    rows = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(),  # greedy: the plain softmax
            SamplingParams(temperature=1.5, top_p=0.8), SamplingParams(temperature=1.0, top_k=7, top_p=0.5)]
    together = process_logits(logits, rows)
    for b, params in enumerate(rows):
        alone = process_logits(logits[b : b + 1], params)[0]
        assert torch.equal(together[b], alone), b
    assert torch.allclose(together[1], torch.softmax(logits[1], -1))
    assert ((together[0] > 0).sum(-1) == 5).all()
    assert torch.allclose(together.sum(-1), torch.ones(4, 3))


def test_tiny_temperature_is_argmax_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-6]])
    probs = process_logits(logits, SamplingParams(temperature=1e-30))
    assert not probs.isnan().any()
    assert probs[0, 1] == 1.0


def test_truncate_keeps_the_top_k_renormalised():
    probs = torch.tensor([[0.1, 0.4, 0.0, 0.3, 0.2]])
    ids, top = truncate(probs, 3)
    assert ids.tolist() == [[1, 3, 4]]
    assert torch.allclose(top, torch.tensor([[4 / 9, 3 / 9, 2 / 9]]))
    ids, top = truncate(probs, 10)  # more room than the vocabulary: everything, zeros last
    assert ids.shape == (1, 5) and top[0, -1] == 0


def test_uniforms_and_race_keys_are_per_position():
    table = uniforms([3, 4], [10, 20], 3, ACCEPT)  # [2, 3]
    assert table[1, 2] == uniform(4, 22, ACCEPT) and table.dtype == torch.float64
    # A row's race key at a position is the 53 bits its uniform at that position is made of.
    assert row_keys([4], [22], ACCEPT).item() == uniform(4, 22, ACCEPT) * 2 ** 53
    # A decode step's few rows are mixed in Python integers, a batch's many in numpy: the same bits,
    # seeds up to 2^63 included.
    seeds, starts = [2 ** 63 - 1 - 7919 * i for i in range(40)], [104729 * i for i in range(40)]
    many = row_keys(seeds, starts, RESIDUAL)  # [40]
    assert torch.equal(torch.cat([row_keys(seeds[i : i + 4], starts[i : i + 4], RESIDUAL) for i in range(0, 40, 4)]),
                       many)
    wide = uniforms(seeds[:3], starts[:3], 8, ACCEPT)  # [3, 8]: numpy
    assert torch.equal(uniforms(seeds[:3], starts[:3], 4, ACCEPT), wide[:, :4])  # [3, 4]: Python integers


def test_plain_sampling_settles_as_the_speculative_rule_with_nothing_proposed():
    """A pass with no proposals settles its sampling rows by the race over p alone; it must pick
    what Leviathan's rule picks with γ = 0, keys included (a row whose guesses were all cut races
    with RESIDUAL noise: the draft's guess used its SAMPLE noise)."""
    from target_service.settle import VerifyRow, settle

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 1, 500, generator=gen) * 3  # [S, 1, V]
    params = [SamplingParams(temperature=t, top_k=k, top_p=tp, seed=100 + i)
              for i, (t, k, tp) in enumerate([(1.0, 0, 1.0), (0.7, 0, 0.9), (1.5, 20, 1.0), (0.3, 0, 1.0),
                                              (1.0, 0, 0.5), (2.0, 0, 1.0)])]
    rows = [VerifyRow(p, position=40 + 3 * i, drafted=2 if i == 5 else 0) for i, p in enumerate(params)]
    tokens = [v.tokens[0] for v in settle(logits, rows)]
    probs = process_logits(logits, params)  # [S, 1, V]
    keys = torch.tensor([[row_keys([p.seed], [r.position], RESIDUAL if r.drafted else SAMPLE).item()]
                         for p, r in zip(params, rows)])  # [S, 1]
    empty = torch.zeros(6, 0, 1)
    _, emitted = speculative_verify(probs, empty.long(), empty, torch.zeros(6, 0, dtype=torch.int64),
                                    torch.zeros(6, dtype=torch.int64), torch.zeros(6, 0, dtype=torch.float64), keys)
    assert tokens == emitted.tolist()
    assert tokens[5] != race(probs[5:6, 0], row_keys([params[5].seed], [rows[5].position], SAMPLE)).item()


def _random_verify_inputs(seed: int, batch: int = 16, gamma: int = 4, vocab: int = 12, support: int = 5):
    """A batch of proposals with every kind of row: short runs, no run, proposals outside q's support."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, -1)
    p = p * (torch.rand(p.shape, generator=gen) > 0.25)  # zeros where a top-k / top-p cut would put them
    p[..., 0] += 1e-3
    p = p / p.sum(-1, keepdim=True)  # [B, G+1, V]
    q_dense = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen) * 2, -1)
    q_ids, q_probs = truncate(q_dense, support)  # [B, G, K]
    draft = q_ids.gather(-1, torch.randint(0, support, (batch, gamma, 1), generator=gen)).squeeze(-1)
    draft[::5, 1] = (draft[::5, 1] + 1) % vocab  # some proposals the draft gave no (or other) mass
    num_draft = torch.randint(0, gamma + 1, (batch,), generator=gen)
    u_accept = torch.rand(batch, gamma, generator=gen, dtype=torch.float64)
    keys = torch.stack([row_keys(range(batch), [seed * 100 + j] * batch, RESIDUAL) for j in range(gamma + 1)], dim=1)
    return p, q_ids, q_probs.float(), draft, num_draft, u_accept, keys


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_verify_matches_the_reference_token_for_token(seed):
    inputs = _random_verify_inputs(seed)
    accepted, emitted = speculative_verify(*inputs)
    ref_accepted, ref_emitted = speculative_verify_reference(*inputs)
    assert accepted.tolist() == ref_accepted.tolist()
    assert emitted.tolist() == ref_emitted.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_the_accepted_distribution_is_the_dense_residual_bit_for_bit(seed):
    """`speculative_accept` overwrites p at q's support instead of building q over the vocabulary:
    its table must be the dense max(0, p - q) (p where that is empty or nothing was rejected) bit for
    bit, with repeated ids in q (their masses summed), proposals q rules out (point masses) and
    rows of every length."""
    p, q_ids, q_probs, draft, num_draft, u_accept, _ = _random_verify_inputs(seed)
    q_ids[1::3, :, 1] = q_ids[1::3, :, 0]  # a repeated id carrying mass
    q_ids[2::3, :, 2:4] = q_ids[2::3, :, :1]  # three slots of one id
    accepted, dist = speculative_accept(p, q_ids, q_probs, draft, num_draft, u_accept)
    batch, positions, vocab = p.shape
    q = torch.zeros(batch, positions - 1, vocab, dtype=torch.float64).scatter_add_(
        2, q_ids.long(), _normalise(q_probs))  # [B, G, V]
    rejected = 0
    for b in range(batch):
        k = int(accepted[b])
        if k == int(num_draft[b]):
            assert torch.equal(dist[b], p[b, k].double())
            continue
        rejected += 1
        q_k = q[b, k].clone()
        if q_k[draft[b, k]] <= 0:  # a point mass on the proposal
            q_k.zero_()
            q_k[draft[b, k]] = 1.0
        residual = (p[b, k].double() - q_k).clamp(min=0.0)
        assert torch.equal(dist[b], residual if float(residual.sum()) > 1e-12 else p[b, k].double()), b
    assert rejected


def test_verify_without_proposals_is_plain_sampling():
    p = torch.softmax(torch.randn(3, 1, 7), -1)  # [B, 1, V]
    keys = row_keys([1, 2, 3], [5, 5, 5], SAMPLE)[:, None]  # [B, 1]
    empty = torch.zeros(3, 0, 1)
    accepted, emitted = speculative_verify(p, empty.long(), empty, torch.zeros(3, 0, dtype=torch.int64),
                                           torch.zeros(3, dtype=torch.int64), torch.zeros(3, 0, dtype=torch.float64),
                                           keys)
    assert accepted.tolist() == [0, 0, 0]
    assert emitted.tolist() == race(p[:, 0], keys[:, 0]).tolist()


def test_top_p_search_window_gives_the_full_sort_answer():
    """Peaked rows take the top-256 shortcut, flat rows the full sort; both must equal the
    plain definition (sort everything, keep the smallest set reaching top_p, ties kept)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 1000) * torch.tensor([8.0, 4.0, 2.0, 0.5, 0.1, 0.0])[:, None]  # peaked ... flat
    for top_p in (0.3, 0.9, 0.99):
        got = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        probs = torch.softmax(logits, -1)
        ranked = torch.sort(probs, -1, descending=True).values
        before = ranked.cumsum(-1) - ranked
        needed = ranked.masked_fill(before >= top_p, float("inf")).amin(-1, keepdim=True)
        kept = probs.masked_fill(probs < needed, 0.0)
        assert torch.equal(got > 0, kept > 0), top_p
        assert torch.allclose(got, kept / kept.sum(-1, keepdim=True))
