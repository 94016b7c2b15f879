"""The γ controller against a simulated engine: known acceptance α per token, known costs.

A simulated step: each row's proposals are accepted one by one with probability α until the first
rejection; the step costs verify(positions) + draft(depth, proposals), positions = rows × (depth + 1)
as in the engine, whose verify forward pads every row to the deepest. The analytic batch-1 optimum is
Leviathan et al.'s argmax_γ (1 − α^(γ+1)) / ((1 − α)(γc + 1)), written out here independently of
the controller's code (tests/support/gamma_sim.py). How it prices guesses, verification, padding
and branches, and learns its costs: tests/test_gamma_costs.py.
"""

from __future__ import annotations

import random
import statistics

import pytest

from target_service.gamma import AUTO_GAMMA, GammaController, RowView, expected_tokens, pooled_source
from tests.support.gamma_sim import MAX_GAMMA, SimulatedEngine, analytic_optimum


def _batch1(alpha: float, c: float, steps: int = 400, seed: int = 0) -> SimulatedEngine:
    sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0,
                          draft=lambda depth, proposals: c * depth, seed=seed)
    for _ in range(steps):
        sim.step(alpha)
    return sim


@pytest.mark.parametrize("c", [0.05, 0.2, 0.5])
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.95])
def test_batch_one_choice_is_within_one_of_the_analytic_optimum(alpha, c):
    sim = _batch1(alpha, c)
    settled = [g[0] for g in sim.chosen[100:]]
    best = analytic_optimum(alpha, c)
    assert abs(statistics.median(settled) - best) <= 1, (best, settled[-30:])


def test_a_marginal_predicted_gain_is_not_taken():
    """α = 0.6 and a guess costing 0.55 of a step: γ = 1 would gain 3.2% (the analytic optimum),
    within what a shared machine's noise and the controller's own estimates can be off by. With
    the default `min_gain` (5%) the controller mostly decodes plainly (it guesses where its
    estimate of α runs high, and probes); with `min_gain` 0 it takes the marginal gain in most
    steps (~0.58 of them: a row whose estimate ran low waits for a probe, which spends at most 2% of
    the time, to guess again).
    Whether a run's estimate runs high is chance: the shares of steps guessing are averaged over
    eight seeded runs each (per run they spread by ~±0.2)."""
    assert analytic_optimum(0.6, 0.55) == 1
    share = {}
    for min_gain in (0.05, 0.0):
        runs = []
        for seed in range(8):
            sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA, min_gain=min_gain), 1,
                                  verify=lambda positions: 1.0, draft=lambda depth, proposals: 0.55 * depth, seed=seed)
            for _ in range(400):
                sim.step(0.6)
            runs.append(statistics.mean(g[0] > 0 for g in sim.chosen[100:]))
        share[min_gain] = statistics.mean(runs)
    assert share[0.05] < 0.45 and share[0.0] > 0.5, share


def test_gamma_goes_to_zero_when_alpha_is_tiny():
    """Apart from rare one-token probes (every 16 idle steps at batch 1, so a sequence whose text
    turns predictable is noticed)."""
    sim = _batch1(0.02, 0.2, steps=300)
    assert analytic_optimum(0.02, 0.2) == 0
    late = [g[0] for g in sim.chosen[50:]]
    assert max(late) <= 1 and sum(late) <= 0.08 * len(late), late


def test_the_quick_bound_never_changes_a_choice(monkeypatch):
    """``_nothing_pays`` lets a step skip the search when no γ vector can gain enough; over random
    costs, batches and acceptances the choices must be the search's own."""
    rng = random.Random(5)
    scenarios = []
    for _ in range(150):
        rows = rng.randint(1, 4)
        v0, v1, d0, d1, s = (rng.uniform(2e-3, 8e-3), rng.uniform(0, 1e-3), rng.uniform(0, 6e-3), rng.uniform(0, 2e-3),
                             rng.uniform(0, 4e-3))
        views = [RowView(i, AUTO_GAMMA if rng.random() < 0.8 else rng.randint(0, 3), MAX_GAMMA, rng.random() < 0.5)
                 for i in range(rows)]
        alphas = [rng.uniform(0.0, 0.9) ** 1.5 for _ in range(rows)]
        scenarios.append((views, alphas, (v0, v1, d0, d1, s), [rng.randint(0, MAX_GAMMA) for _ in range(rows)]))

    def choices() -> list[list[int]]:
        out = []
        for views, alphas, (v0, v1, d0, d1, s), caps in scenarios:
            controller = GammaController(max_gamma=MAX_GAMMA)
            for depth in range(4):
                sampled_rows = sum(1 for v in views if not v.greedy) if depth else 0
                controller.observe_step(len(views), depth, depth * len(views),
                                        v0 + v1 * len(views) * (depth + 1) + s * sampled_rows,
                                        d0 + d1 * depth if depth else 0.0, 0.0, 0, 0, sampled_rows)
            for i, (view, alpha) in enumerate(zip(views, alphas)):
                controller.observe(i, "model", view.greedy, 10, int(10 * alpha))
            out.append(controller.choose(views, caps))
        return out

    quick = choices()
    monkeypatch.setattr(GammaController, "_nothing_pays", lambda self, *args: False)
    assert quick == choices()
    assert any(any(g) for g in quick) and any(not any(g) for g in quick)  # both kinds of answer occur


def test_the_batch_of_one_path_chooses_as_the_search_does(monkeypatch):
    """A step of one auto row skips the vector search (``_goodput_one``: every depth in turn); over
    random costs (verify staircases included), acceptances, caps and greedy or sampling rows, its γ
    and predicted step time must be the search's own."""
    rng = random.Random(11)
    scenarios = []
    for _ in range(300):
        v0, v1, d0, d1, s = (rng.uniform(2e-3, 8e-3), rng.uniform(0, 1.5e-3), rng.uniform(0, 4e-3),
                             rng.uniform(0, 2e-3), rng.uniform(0, 3e-3))
        steps = rng.randint(4, 12)
        stair = {p: rng.uniform(-1e-3, 2e-3) for p in range(1, MAX_GAMMA + 2)}  # what a line misses per size
        view = RowView(0, AUTO_GAMMA, rng.choice([MAX_GAMMA, rng.randint(1, 8)]), rng.random() < 0.6)
        alpha = rng.uniform(0.0, 0.95) ** rng.choice([0.5, 1.0, 2.0])
        scenarios.append((view, alpha, (v0, v1, d0, d1, s), steps, stair, rng.randint(0, MAX_GAMMA)))

    def choices() -> list[tuple[int, float]]:
        out = []
        for view, alpha, (v0, v1, d0, d1, s), steps, stair, cap in scenarios:
            controller = GammaController(max_gamma=MAX_GAMMA)
            for step in range(steps):
                depth = step % 5
                sampled = 0 if view.greedy or not depth else 1
                controller.observe_step(1, depth, depth, v0 + v1 * (depth + 1) + stair[depth + 1] + s * sampled,
                                        d0 + d1 * depth if depth else 0.0, 0.0, 1, depth * sampled, sampled)
            controller.observe(0, "model", view.greedy, 20, int(20 * alpha))
            out.append((controller.choose([view], [cap])[0], controller.predicted_s))
        return out

    quick = choices()
    monkeypatch.setattr(GammaController, "_goodput_one",
                        lambda self, gammas, row, limit, alpha: self._goodput(gammas, [0], {0: limit}, {0: alpha}, [row]))
    assert quick == choices()
    chosen = {g for g, _ in quick}
    assert 0 in chosen and 1 in chosen and max(chosen) >= 4, chosen  # plain, short and deep chains all occur


def test_a_new_rows_first_choice_starts_from_the_drafts_stated_acceptance():
    """Before anything is verified, a row's estimate is its pool's prior: the card's α for the
    draft's proposals of that kind (``set_priors``), else ``prior_alpha``. Where a guess costs half
    a step, a draft stated at α = 0.2 is not asked at first, the default prior's 0.6 is; sampled
    rows and other proposers keep the default."""
    def first_choice(priors: dict, greedy: bool = True) -> int:
        controller = GammaController(max_gamma=MAX_GAMMA, explore=0.0)
        controller.set_priors(priors)
        for depth in (0, 1, 2, 0):  # measured steps: the verify is flat, a guess costs half a step
            controller.observe_step(1, depth, depth, 0.01, 0.005 * depth, 0.0)
        return controller.choose([RowView(1, AUTO_GAMMA, MAX_GAMMA, greedy)], [MAX_GAMMA])[0]

    assert first_choice({}) > 0
    assert first_choice({("model", True): 0.2}) == 0
    assert first_choice({("model", True): 0.2}, greedy=False) > 0  # a sampled row: no stated prior
    assert first_choice({("ngram", True): 0.2}) > 0  # another proposer's prior


def test_constrained_rows_learn_their_acceptance_apart_from_free_text():
    """A draft refused on prose but right under a grammar (or the other way round): each kind of
    row is chosen from its own pool (``pooled_source``), so a new constrained row drafts after
    constrained rows were kept, while a new free row, after free rows were refused, does not."""
    controller = GammaController(max_gamma=MAX_GAMMA, explore=0.0)
    controller.set_priors({("model", True): 0.5})
    for depth in (0, 1, 2, 0):  # measured steps: the verify is flat, a guess costs half a step
        controller.observe_step(1, depth, depth, 0.01, 0.005 * depth, 0.0)
    for seq_id in range(1, 21):  # finished rows: free ones refused, constrained ones kept
        constrained = seq_id % 2 == 0
        controller.choose([RowView(seq_id, AUTO_GAMMA, MAX_GAMMA, True, constrained=constrained)], [MAX_GAMMA])
        for _ in range(10):
            controller.observe(seq_id, pooled_source("model", constrained), True, 3, 3 if constrained else 0)
        controller.forget(seq_id)
    assert controller.pooled_alpha("model+grammar", True) > 0.9 > 0.1 > controller.pooled_alpha("model", True)
    free = controller.choose([RowView(100, AUTO_GAMMA, MAX_GAMMA, True)], [MAX_GAMMA])[0]
    constrained = controller.choose([RowView(101, AUTO_GAMMA, MAX_GAMMA, True, constrained=True)], [MAX_GAMMA])[0]
    assert free == 0 < constrained


def test_forced_tokens_are_priced_at_batch_one():
    """A constrained row's forced tokens are certain and free to propose, so the guesses after them
    add fewer tokens to the pass in proportion: where a draft call costs a fifth of a step, α = 0.6
    pays for guesses on a free row and not after a few forced tokens."""
    controller = GammaController(max_gamma=MAX_GAMMA, explore=0.0)
    for depth in (0, 1, 2, 4, 8, 0, 3):  # a 10 ms step, 0.5 ms more a position; a call 2 ms, 1 ms a guess
        controller.observe_step(1, depth, depth, 0.010 + 0.0005 * depth, (0.002 + 0.001 * depth) if depth else 0.0, 0.0)
    chosen = [controller.choose([RowView(1, AUTO_GAMMA, MAX_GAMMA, True, forced=f)], [MAX_GAMMA])[0] for f in (0, 6)]
    assert chosen[0] > 0 == chosen[1]


def test_forced_tokens_are_priced_in_a_batch():
    """In a batch the verify is padded to the deepest row's forced tokens and guesses: two free rows
    at α = 0.6 guess, two rows with 6 forced tokens each do not; each choice, mixed batches too, is
    the best of every γ vector under the same costs (an exhaustive search)."""
    import itertools

    controller = GammaController(max_gamma=MAX_GAMMA, explore=0.0)
    for rows, depth in ((1, 0), (2, 1), (2, 2), (1, 4), (2, 8), (2, 0), (1, 3), (2, 5)):
        verify_s = 0.010 + 0.0005 * rows * (depth + 1)
        controller.observe_step(rows, depth, rows * depth, verify_s, (0.001 + 0.0003 * rows * depth) if depth else 0.0,
                                0.0)

    def chosen(forced: tuple[int, int]) -> list[int]:
        views = [RowView(k + 1, AUTO_GAMMA, MAX_GAMMA, True, forced=f) for k, f in enumerate(forced)]
        gammas = controller.choose(views, [MAX_GAMMA] * 2)
        alphas = [controller._optimistic_alpha(k + 1, True, 2) for k in range(2)]

        def rate(vector) -> float:
            reach = [f + g for f, g in zip(forced, vector)]
            seconds = controller._step_s(2, max(reach), max((r for r, g in zip(reach, vector) if g), default=0),
                                         sum(vector), sum(1 for g in vector if g), 0, 0)
            return sum(f + expected_tokens(a, g) for f, a, g in zip(forced, alphas, vector)) / seconds

        best = max(itertools.product(range(MAX_GAMMA + 1), repeat=2), key=rate)
        assert rate(gammas) >= rate(best) * (1 - 1e-6) or rate(best) < rate((0, 0)) * (1 + controller.min_gain)
        return gammas

    assert all(chosen((0, 0)))
    assert chosen((6, 6)) == [0, 0]
    for mixed in ((0, 3), (0, 6), (2, 5)):
        chosen(mixed)


def test_probes_of_a_row_far_from_paying_grow_rare():
    """At α = 0.1 with a guess costing half a step, a probe costs far more than it wins: after a
    few refused probes a row waits 16 × 2^3 idle steps for the next one (16 without the back-off:
    ~25 probes in 400 steps)."""
    sim = _batch1(0.1, 0.5, steps=600)
    late = [g[0] for g in sim.chosen[200:]]
    assert 1 <= sum(1 for g in late if g) <= 5, late


def _hopeless_rows(probe_share: float, steps: int = 3000) -> tuple[int, float, float]:
    """Batch 1, greedy, α = 0.05, 96-token sequences after a 60-token prompt; verify 1.0 s + 0.3
    s per extra position; a draft call 0.2 s + 0.02 s per token it takes in (all the tokens it has
    not seen since its last call: the prompt at a sequence's first). Returns (probes, their
    seconds beyond a plain step, the plain steps' seconds)."""
    controller = GammaController(max_gamma=MAX_GAMMA, probe_share=probe_share)
    rng = random.Random(3)
    seq_id, length, unfed, probes, extra, plain = 0, 96, 0, 0, 0.0, 0.0
    for _ in range(steps):
        if length == 96:
            seq_id, length, unfed = seq_id + 1, 0, 60
            controller.forget(seq_id - 1)
        unfed += 1
        (g,) = controller.choose([RowView(seq_id, AUTO_GAMMA, MAX_GAMMA, True, unfed)], [MAX_GAMMA])
        k = 0
        while k < g and rng.random() < 0.05:
            k += 1
        controller.observe(seq_id, "model", True, g, k)
        verify_s, draft_s = 1.0 + 0.3 * g, (0.2 + 0.02 * unfed) if g else 0.0
        controller.observe_step(1, g, g, verify_s, draft_s, 0.0, fed=unfed if g else 0)
        if g:
            probes, extra, unfed = probes + 1, extra + verify_s + draft_s - 1.0, 0
        else:
            plain += verify_s
        length += k + 1
    return probes, extra, plain


def test_probes_spend_at_most_their_share_of_the_time_and_still_come():
    """On text no guess pays for, probes (each a draft call that first takes in every token the
    row's draft has not seen, and a wider verify) cost at most ``probe_share`` of the time spent
    decoding plainly, over sequences too short for a row's own back-off to matter, and they still
    come (a probe dearer than the credit can hold, at 1%, goes when it is full). Without the budget
    (a share of 1: every 16 idle steps, doubling after refusals) they cost ~3.6% here."""
    probes, extra, plain = _hopeless_rows(0.02)
    # 10%: the cost fit's first predictions, before it has seen a dear catch-up
    assert probes >= 10 and extra <= 0.02 * plain * 1.1, (probes, extra, plain)
    few, few_extra, few_plain = _hopeless_rows(0.01)
    # of 16 probes, the first few mispredicted ones weigh more
    assert 10 <= few < probes and few_extra <= 0.015 * few_plain, (few, few_extra, few_plain)
    unbudgeted, more_extra, more_plain = _hopeless_rows(1.0)
    assert unbudgeted > 1.5 * probes and more_extra > 0.03 * more_plain, (unbudgeted, more_extra, more_plain)


def test_the_budget_spares_a_row_near_paying():
    """With almost no probe budget, a row near paying (α 0.4 where one guess costs half a step:
    the probe pays at α ≈ 0.58, within PROBE_GAP of the row's estimate) is still probed every 16
    idle steps, while a row far from it (α 0.05) all but stops being probed."""
    def probes(alpha: float) -> int:
        sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA, probe_share=0.001), 1,
                              verify=lambda positions: 1.0, draft=lambda depth, proposals: 0.5 * depth, seed=2)
        for _ in range(600):
            sim.step(alpha)
        return sum(1 for g in sim.chosen[100:] if g[0] == 1)

    near, far = probes(0.4), probes(0.05)
    assert near >= 20 and far <= 3, (near, far)


def test_a_pessimistic_pool_does_not_lock_later_sequences_out():
    """Hard sequences first (α 0.1) drive the pooled estimate down until new sequences start at
    γ = 0; when easy ones (α 0.9) follow, probes find out and the controller speculates again."""
    controller = GammaController(max_gamma=MAX_GAMMA)
    rng = random.Random(4)
    seq_id, chosen = 0, []
    for alpha, sequences in [(0.1, 6), (0.9, 6)]:
        for _ in range(sequences):
            seq_id += 1
            for _ in range(60):
                (g,) = controller.choose([RowView(seq_id, AUTO_GAMMA, MAX_GAMMA, True)], [MAX_GAMMA])
                k = 0
                while k < g and rng.random() < alpha:
                    k += 1
                controller.observe(seq_id, "model", True, g, k)
                controller.observe_step(1, g, g, 1.0, 0.5 * g, 0.0)
                chosen.append((alpha, g))
            controller.forget(seq_id)
    hard = [g for a, g in chosen[120:360] if a == 0.1]
    easy = [g for a, g in chosen[-120:]]
    assert sum(hard) <= 0.1 * len(hard), hard  # c = 0.5: nothing pays at α 0.1
    assert sum(g >= 2 for g in easy) >= 0.8 * len(easy), easy  # analytic optimum at α 0.9, c 0.5: 3


def test_gamma_goes_to_zero_when_verify_cost_grows_steeply_with_tokens():
    """A compute-bound target (every token costs as much as a row) under a full batch: a
    proposal can never pay for itself (E(γ) < γ + 1), so the controller stops proposing."""
    sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 32, verify=lambda positions: 0.001 * positions,
                          draft=lambda depth, proposals: 0.002 * depth)
    for _ in range(150):
        sim.step(0.7)
    late = [sum(g) for g in sim.chosen[50:]]
    assert sum(late) == 0, late[:20]


def test_batch_one_speculates_when_verify_is_flat_but_stops_when_the_batch_makes_it_steep():
    """The same α and draft, two devices: flat verify cost (memory-bound) and one growing with
    tokens past a batch's worth. Acceptance alone cannot tell these apart; the cost model can."""
    flat = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 4, verify=lambda positions: 1.0,
                           draft=lambda depth, proposals: 0.1 * depth)
    steep = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 4, verify=lambda positions: 0.25 * positions,
                            draft=lambda depth, proposals: 0.1 * depth)
    for _ in range(200):
        flat.step(0.8)
        steep.step(0.8)
    assert statistics.median(sum(g) / 4 for g in flat.chosen[100:]) >= 3
    # steep: nothing but the rare one-row probe (one step in 16 × 4)
    assert all(sum(g) <= 1 for g in steep.chosen[100:]) and sum(sum(g) for g in steep.chosen[100:]) <= 2


def test_reconverges_when_alpha_changes_mid_sequence():
    """α drops from 0.9 to 0.3 and comes back. From 45 steps after each change on, the choices lose
    under 3% of the best speedup on average (the optimum's neighbours are almost as good: at α 0.9,
    γ 8..12 are within 1% of γ = 10, so the test measures speed, not the exact γ)."""
    c = 0.1

    def speedup(alpha: float, g: int) -> float:
        return (1 - alpha ** (g + 1)) / ((1 - alpha) * (g * c + 1))

    for seed in (3, 4, 5):
        sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0,
                              draft=lambda depth, proposals: c * depth, seed=seed)
        for alpha, steps in [(0.9, 150), (0.3, 150), (0.9, 150)]:
            start = len(sim.chosen)
            for _ in range(steps):
                sim.step(alpha)
            best = speedup(alpha, analytic_optimum(alpha, c))
            after = [g[0] for g in sim.chosen[start + 45: start + steps]]
            loss = sum(1 - speedup(alpha, g) / best for g in after) / len(after)
            assert loss < 0.03, (seed, alpha, after)
            assert statistics.median(after) == pytest.approx(analytic_optimum(alpha, c), abs=2), (seed, alpha, after)


def test_goodput_beats_every_fixed_gamma_on_a_mixed_batch():
    """Half the rows predictable (α 0.9), half not (α 0.2), a draft whose cost grows with the
    proposals it makes: per-row choices (the predictable rows draft deep, the others not at all)
    commit more tokens per second than the best single γ for everyone."""
    def run(policy: str, gamma: int) -> float:
        controller = GammaController(policy, default_gamma=gamma, max_gamma=MAX_GAMMA)
        rng = random.Random(1)
        committed, seconds = 0, 0.0
        for _ in range(300):
            views = [RowView(i, AUTO_GAMMA, MAX_GAMMA, True) for i in range(8)]
            gammas = controller.choose(views, [MAX_GAMMA] * 8)
            for i, g in enumerate(gammas):
                alpha = 0.9 if i < 4 else 0.2
                k = 0
                while k < g and rng.random() < alpha:
                    k += 1
                controller.observe(i, "model", True, g, k)
                committed += k + 1
            depth, proposals = max(gammas), sum(gammas)
            verify_s = 1.0 + 0.005 * 8 * (depth + 1)
            draft_s = 0.02 * depth + 0.05 * proposals if proposals else 0.0
            controller.observe_step(8, depth, proposals, verify_s, draft_s, 0.0)
            seconds += verify_s + draft_s
        return committed / seconds

    ours = run("goodput", 4)
    fixed = {g: run("fixed", g) for g in (0, 1, 2, 3, 4, 6, 8)}
    assert ours >= 1.05 * max(fixed.values()), (ours, fixed)


def test_catching_up_is_not_read_as_the_price_of_a_guess():
    """A row's first proposal feeds the draft its whole prompt (here 8 × 150 tokens: 0.24 s), and
    a row that sat at γ = 0 feeds everything since. With α = 0.8 and a draft at 2 ms per forward
    on a 20 ms step, drafting pays off; the catch-up step must not make the draft look so dear
    that γ stays 0 for the rest of the run."""
    rows, alpha = 8, 0.8
    controller = GammaController(max_gamma=MAX_GAMMA)
    rng = random.Random(3)
    held = [0] * rows  # tokens the draft holds per row
    length = [150] * rows  # tokens per row
    chosen = []
    for _ in range(200):
        gammas = controller.choose([RowView(i, AUTO_GAMMA, MAX_GAMMA, True) for i in range(rows)], [MAX_GAMMA] * rows)
        fed = sum(length[i] - held[i] for i in range(rows) if gammas[i] > 0)
        for i, g in enumerate(gammas):
            k = 0
            while k < g and rng.random() < alpha:
                k += 1
            controller.observe(i, "model", True, g, k)
            if g > 0:
                held[i] = length[i] + k  # the draft fed its accepted guesses too
            length[i] += k + 1
        depth, proposals = max(gammas), sum(gammas)
        verify_s = 0.02 + 0.0005 * rows * (depth + 1)
        draft_s = 0.002 * depth + 0.0002 * proposals + 0.0002 * fed if proposals else 0.0
        controller.observe_step(rows, depth, proposals, verify_s, draft_s, 0.0, fed)
        chosen.append(gammas)
    settled = [statistics.mean(g) for g in chosen[50:]]
    assert statistics.mean(settled) >= 2.0, chosen[40:50]
    assert controller.costs.draft_s(1, 1) == pytest.approx(0.0024, rel=0.5), controller.costs.terms()


def test_a_row_priced_out_by_its_model_still_gets_its_lookup_asked_where_it_pays():
    """A row whose draft model guesses badly gets γ 0; ``lookup_gamma`` prices asking the
    model-free lookup in front of it alone, at the lookup's α: as deep as it may where verify
    positions cost nothing, not at all where each costs a whole step, and less as the row's own
    lookup guesses fail. Nothing before the step costs are measured."""
    assert GammaController(max_gamma=MAX_GAMMA).lookup_gamma([RowView(0, AUTO_GAMMA, MAX_GAMMA, True)], [0], 0,
                                                              "ngram", 8) == 0
    flat = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0,
                           draft=lambda depth, proposals: 0.5 * depth)
    steep = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0 * positions,
                            draft=lambda depth, proposals: 0.5 * depth)
    gentle = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0 + 0.1 * positions,
                             draft=lambda depth, proposals: 0.5 * depth)
    for sim in (flat, steep, gentle):
        for _ in range(200):
            sim.step(0.05)  # the model: priced out
        assert sim.chosen[-1] == [0]
    view = [RowView(0, AUTO_GAMMA, MAX_GAMMA, True)]
    assert flat.controller.lookup_gamma(view, [0], 0, "ngram", 8) == 8
    capped = [RowView(0, AUTO_GAMMA, 4, True)]  # the request's max_gamma bounds the lookup as it bounds the model
    assert flat.controller.lookup_gamma(capped, [0], 0, "ngram", 8) == 4
    assert steep.controller.lookup_gamma(view, [0], 0, "ngram", 8) == 0
    at_prior = gentle.controller.lookup_gamma(view, [0], 0, "ngram", 8)
    assert at_prior > 0
    for _ in range(30):  # this row's lookup guesses fail
        gentle.controller.observe(0, "ngram", True, 4, 0)
    assert gentle.controller.lookup_gamma(view, [0], 0, "ngram", 8) < at_prior


def test_a_constrained_rows_lookup_is_priced_on_its_own_pool():
    """A constrained row's lookup (draft_service/grammar_lookup.py) is asked alone too, priced by
    what its lookup guesses kept under the grammar (``ngram+grammar``), apart from the same
    proposer's free-text record: failures there lower its γ and leave the free row's as it was."""
    gentle = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=lambda positions: 1.0 + 0.1 * positions,
                             draft=lambda depth, proposals: 0.5 * depth)
    for _ in range(200):
        gentle.step(0.05)  # the model: priced out
    free, constrained = [RowView(0, AUTO_GAMMA, MAX_GAMMA, True)], [RowView(0, AUTO_GAMMA, MAX_GAMMA, True,
                                                                             constrained=True, forced=2)]
    free_gamma = gentle.controller.lookup_gamma(free, [0], 0, "ngram", 8)
    at_prior = gentle.controller.lookup_gamma(constrained, [0], 0, "ngram", 8)
    assert free_gamma > 0 and at_prior > 0
    for _ in range(30):  # its lookup guesses under the grammar fail
        gentle.controller.observe(0, "ngram+grammar", True, 4, 0)
    assert gentle.controller.lookup_gamma(constrained, [0], 0, "ngram", 8) < at_prior
    assert gentle.controller.lookup_gamma(free, [0], 0, "ngram", 8) == free_gamma


def test_a_row_a_self_limiting_proposer_answered_gets_its_limit_alone_and_no_wider_verify_in_a_batch():
    """Suffix drafting ends its chains where its own confidence does: a row it answered, given any
    γ, asks up to its limit at batch 1 (the proposer decides how far), and in a step shared with
    other rows up to the deepest γ already verified there (a longer chain would pad every row).
    Prompt lookup's rows keep the γ the controller priced; nothing changes before costs are measured."""
    from target_service.gamma import SELF_LIMITING

    assert "suffix" in SELF_LIMITING and "ngram" not in SELF_LIMITING
    gentle = lambda positions: 1.0 + 0.1 * positions  # noqa: E731
    one = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=gentle, draft=lambda d, p: 0.0)
    for _ in range(60):
        one.step(0.7)
    view = [RowView(0, AUTO_GAMMA, MAX_GAMMA, True)]
    priced = one.controller.choose(view, [MAX_GAMMA])[0]
    assert 0 < priced < MAX_GAMMA
    one.controller.observe(0, "ngram", True, 4, 3)  # answered by prompt lookup: priced as before
    assert one.controller.choose(view, [MAX_GAMMA])[0] < MAX_GAMMA
    one.controller.observe(0, "suffix", True, 4, 3)
    assert one.controller.choose(view, [MAX_GAMMA])[0] == MAX_GAMMA
    assert one.controller.choose([RowView(0, AUTO_GAMMA, 6, True)], [MAX_GAMMA])[0] == 6  # the request's cap
    assert one.controller.lookup_gamma(view, [0], 0, "suffix", 9) == 9

    two = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 2, verify=gentle, draft=lambda d, p: 0.0)
    for _ in range(60):
        two.step(0.7)
    views = [RowView(i, AUTO_GAMMA, MAX_GAMMA, True) for i in range(2)]
    before = two.controller.choose(views, [MAX_GAMMA] * 2)
    two.controller.observe(0, "suffix", True, 4, 3)
    after = two.controller.choose(views, [MAX_GAMMA] * 2)
    assert after[0] >= before[0] and max(after) == max(before) < MAX_GAMMA
