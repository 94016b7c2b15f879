"""The γ controller's prices: a sampling row's guesses and verification priced apart, a padded row
costing as a drafting one, requested γ and caps respected, the heuristics' rules, statistics per
proposer and kind, verify costs learnt (blocks, an unlucky sample, a pause) and branches bought only
where a position is cheap — against the simulated engine of tests/support/gamma_sim.py."""

from __future__ import annotations

import random
import statistics

import pytest

from target_service.gamma import AUTO_GAMMA, GammaController, RowView
from tests.support.gamma_sim import MAX_GAMMA, SimulatedEngine


def _verify_guesses(controller: GammaController, views: list[RowView], gammas: list[int], rng: random.Random,
                    alpha: float) -> None:
    """Each row's guesses stand one by one with probability ``alpha`` until the first refusal; the
    controller is told."""
    for view, g in zip(views, gammas):
        k = 0
        while k < g and rng.random() < alpha:
            k += 1
        controller.observe(view.seq_id, "model", view.greedy, g, k)


def test_a_sampling_rows_guesses_are_priced_apart():
    """A sampling row's guess also builds and sends its q. A server first serves greedy rows
    (200 steps of two), then a greedy and a sampling row side by side, all at α = 0.6: a verify
    of 6 ms + 0.1 ms per position, a draft call of 2.5 ms + 0.2 ms per depth and per guess, and
    0.6 ms more per sampling row's guess. The controller should learn that 0.6 ms and draft the
    sampling row less deep than the greedy one; a cost model that cannot tell the two kinds apart
    gives them the same γ."""
    controller = GammaController(max_gamma=MAX_GAMMA)
    rng = random.Random(3)
    chosen = []
    for step in range(600):
        views = [RowView(0, AUTO_GAMMA, MAX_GAMMA, True), RowView(1, AUTO_GAMMA, MAX_GAMMA, step < 200)]
        gammas = controller.choose(views, [MAX_GAMMA] * 2)
        _verify_guesses(controller, views, gammas, rng, 0.6)
        depth, proposals = max(gammas), sum(gammas)
        sampled = 0 if views[1].greedy else gammas[1]
        verify_s = 0.006 + 0.0001 * 2 * (depth + 1)
        draft_s = 0.0025 + 0.0002 * depth + 0.0002 * proposals + 0.0006 * sampled if proposals else 0.0
        controller.observe_step(2, depth, proposals, verify_s, draft_s, 0.0, 0, sampled)
        chosen.append(gammas)
    greedy = statistics.mean(g[0] for g in chosen[300:])
    sampling = statistics.mean(g[1] for g in chosen[300:])
    assert greedy >= 2 and sampling < greedy - 0.5, (greedy, sampling, chosen[-20:])
    assert controller.costs.sampled_s() == pytest.approx(0.0006, rel=0.3), controller.costs.terms()


def test_a_sampling_rows_verification_is_priced_apart():
    """A sampling row that proposes settles by Leviathan's rule (its residual) where a greedy row
    takes an argmax: a fixed amount per such row, whatever its γ. A greedy and a sampling row at
    α = 0.8, a verify of 6 ms + 0.1 ms per position and 6 ms more when the sampling row proposes,
    a draft call of 1 ms + 0.2 ms per depth and per guess: the greedy row should draft and the
    sampling row, which would cost more than it wins, should not (beyond its probes). A cost model
    blind to the term gives both the same γ. The verify line is timed first, as the engine does at
    start-up; the sampled term is not (its prior is 0): it is learnt from the steps."""
    controller = GammaController(max_gamma=MAX_GAMMA)
    for positions in range(1, 2 * MAX_GAMMA + 3):
        controller.costs.observe_verify(positions, 0.006 + 0.0001 * positions)
    rng = random.Random(4)
    chosen = []
    for _ in range(400):
        views = [RowView(0, AUTO_GAMMA, MAX_GAMMA, True), RowView(1, AUTO_GAMMA, MAX_GAMMA, False)]
        gammas = controller.choose(views, [MAX_GAMMA] * 2)
        _verify_guesses(controller, views, gammas, rng, 0.8)
        depth, proposals = max(gammas), sum(gammas)
        sampled_rows = int(gammas[1] > 0)
        verify_s = 0.006 + 0.0001 * 2 * (depth + 1) + 0.006 * sampled_rows
        draft_s = 0.001 + 0.0002 * depth + 0.0002 * proposals if proposals else 0.0
        controller.observe_step(2, depth, proposals, verify_s, draft_s, 0.0, 0, gammas[1], sampled_rows)
        chosen.append(gammas)
    greedy = statistics.mean(g[0] for g in chosen[100:])
    sampling = statistics.mean(g[1] for g in chosen[100:])
    assert greedy >= 2 and sampling < 0.2, (greedy, sampling, chosen[-20:])
    assert controller.costs.terms()["verify_sampled"] == pytest.approx(0.006, rel=0.3), controller.costs.terms()


def test_a_padded_row_costs_as_much_as_a_drafting_one():
    """The verify forward pads every row to the deepest: when verifying is expensive per position,
    one row drafting deep costs the whole batch, so a batch of mostly unpredictable rows gets γ = 0
    throughout instead of γ > 0 for the one predictable row."""
    controller = GammaController(max_gamma=MAX_GAMMA)
    rng = random.Random(2)
    chosen = []
    for _ in range(200):
        views = [RowView(i, AUTO_GAMMA, MAX_GAMMA, True) for i in range(16)]
        gammas = controller.choose(views, [MAX_GAMMA] * 16)
        for i, g in enumerate(gammas):
            alpha = 0.8 if i == 0 else 0.05
            k = 0
            while k < g and rng.random() < alpha:
                k += 1
            controller.observe(i, "model", True, g, k)
        depth = max(gammas)
        controller.observe_step(16, depth, sum(gammas), 0.01 * 16 * (depth + 1), 0.001 * depth, 0.0)
        chosen.append(gammas)
    assert sum(max(g) for g in chosen[50:]) <= 0.05 * len(chosen[50:]), chosen[50:60]


def test_requested_gammas_and_caps_are_respected():
    controller = GammaController(max_gamma=MAX_GAMMA)
    rows = [RowView(0, 3, 3, True), RowView(1, 0, 0, True), RowView(2, AUTO_GAMMA, 2, True),
            RowView(3, AUTO_GAMMA, MAX_GAMMA, True)]
    for _ in range(30):
        gammas = controller.choose(rows, [MAX_GAMMA, MAX_GAMMA, MAX_GAMMA, 1])
        assert gammas[0] == 3 and gammas[1] == 0 and gammas[2] <= 2 and gammas[3] <= 1
        for i, g in enumerate(gammas):
            controller.observe(i, "model", True, g, g)
        controller.observe_step(4 + sum(gammas), max(gammas), sum(gammas), 1.0, 0.01 * max(gammas), 0.0)
    assert controller.choose(rows, [1, 1, 1, 1]) == [1, 0, 1, 1]  # a cap below a fixed γ wins too


def test_hf_heuristic_follows_its_rule():
    controller = GammaController("hf", max_gamma=MAX_GAMMA)
    row = [RowView(7, AUTO_GAMMA, MAX_GAMMA, True)]
    assert controller.choose(row, [MAX_GAMMA]) == [5]
    controller.observe(7, "model", True, 5, 5)
    assert controller.choose(row, [MAX_GAMMA]) == [7]
    controller.observe(7, "model", True, 7, 2)
    assert controller.choose(row, [MAX_GAMMA]) == [6]
    for _ in range(10):
        controller.observe(7, "model", True, 1, 0)
    assert controller.choose(row, [MAX_GAMMA]) == [1]


def test_statistics_are_per_proposer_and_per_kind():
    controller = GammaController(max_gamma=MAX_GAMMA)
    for _ in range(40):
        controller.observe(1, "ngram", True, 4, 4)
        controller.observe(2, "model", False, 4, 0)
    assert controller.pooled_alpha("ngram", True) > 0.9
    assert controller.pooled_alpha("model", False) < 0.1
    assert controller.pooled_alpha("model", True) == controller.prior_alpha  # nothing seen for this kind
    assert controller.alpha(1, True) > 0.9 and controller.alpha(2, False) < 0.1
    assert controller.alpha(3, True) == controller.prior_alpha  # a new sequence starts at the pool


def _staircase(positions: int) -> float:
    """A verify cost in blocks of 4 positions, as the CPU int4 kernel gives on SmolLM2 (there a
    verify over 4 positions costs 1.06× a step, over 5 1.3×): within a block each position adds
    1% of a step, a new block 30%."""
    return 1.0 + 0.01 * (positions - 1) + 0.3 * ((positions - 1) // 4)


def test_a_verify_cost_in_blocks_is_learnt():
    """α 0.8, c 0.05 over a staircase verify cost: the best γ is 3 (4 positions, the end of the
    first block), and γ = 7 (the end of the second) is a local optimum 3% below it, which a line
    through the staircase cannot tell from the best. With a per-size correction the goodput over 8
    seeds averages ≥ 0.965 of the best achievable (the line alone averaged 0.946)."""
    alpha, c = 0.8, 0.05

    def rate(g: int) -> float:
        return (1 - alpha ** (g + 1)) / (1 - alpha) / (_staircase(g + 1) + c * g)
    assert max(range(MAX_GAMMA + 1), key=rate) == 3
    achieved = []
    for seed in range(8):
        sim = SimulatedEngine(GammaController(max_gamma=MAX_GAMMA), 1, verify=_staircase,
                              draft=lambda depth, proposals: c * depth, seed=seed)
        for _ in range(600):
            sim.step(alpha)
        achieved.append(sim.committed / sim.seconds / rate(3))
    assert statistics.mean(achieved) >= 0.965, achieved


def test_one_unlucky_verify_sample_fades():
    """A size measured once, slowly (a pause in that forward), is tried again later."""
    from target_service.cost_model import CostModel

    costs = CostModel()
    for _ in range(50):
        costs.observe(1, 0, 0, 1.0, 0.0, 0.0)
        costs.observe(2, 1, 1, 1.0, 0.1, 0.0)
    costs.observe(3, 2, 2, 5.0, 0.2, 0.0)  # one slow sample at 3 positions
    assert costs.verify_s(3) > 3.0
    for _ in range(250):
        costs.observe(1, 0, 0, 1.0, 0.0, 0.0)
        costs.observe(2, 1, 1, 1.0, 0.1, 0.0)
    assert costs.verify_s(3) < 1.2  # back near the line after 500 steps at other sizes


def test_a_pause_in_a_measured_step_counts_little():
    """A pause during a forward of a size measured many times (the plain step) must not make that
    size look dear: it would make every guess look cheap beside it."""
    from target_service.cost_model import CostModel

    costs = CostModel()
    for _ in range(50):
        costs.observe(1, 0, 0, 1.0, 0.0, 0.0)
        costs.observe(2, 1, 1, 1.0, 0.1, 0.0)
    costs.observe(1, 0, 0, 5.0, 0.0, 0.0)  # a pause
    assert 1.0 < costs.verify_s(1) < 1.1


def _measured(verify_per_position: float, alpha_hits: int = 6, alpha_misses: int = 4) -> GammaController:
    """A goodput controller whose verify costs 5 ms + ``verify_per_position`` per position, with a
    draft at ~0.2 ms a guess and a row (id 1) that kept ``alpha_hits`` of its guesses."""
    controller = GammaController(max_gamma=MAX_GAMMA)
    for positions in (1, 2, 4, 8, 12) * 6:
        controller.costs.observe(positions, max(positions - 1, 1), max(positions - 1, 1),
                                 0.005 + verify_per_position * positions, 0.0002 * positions, 0.0005)
    for _ in range(alpha_hits):
        controller.observe(1, "model", True, 1, 1)
    for _ in range(alpha_misses):
        controller.observe(1, "model", True, 1, 0)
    return controller


def test_branches_are_bought_only_where_a_position_is_cheap():
    """A branch at depth j adds α^j (1 − α) β tokens a pass: at ~0 s a position (a memory-bound
    device) every allowed branch pays, at 1 ms a position on a 6 ms pass none does; sampled rows
    are priced as greedy ones (their runner-ups are the draft's next draws); rows not drafting and
    a cap of 0 get none."""
    row = RowView(1, AUTO_GAMMA, MAX_GAMMA, True)
    cheap, dear = _measured(1e-7), _measured(1e-3)
    assert cheap.branches([row], [3], 3) == [3]
    assert dear.branches([row], [3], 3) == [0]
    sampled = RowView(2, AUTO_GAMMA, MAX_GAMMA, False)
    assert cheap.branches([row, sampled, row], [3, 3, 0], 3) == [3, 3, 0]
    assert cheap.branches([row], [3], 0) == [0]
    # Fewer branches than the cap where the deeper ones stop paying: a branch at depth j needs the j
    # guesses before it kept, so with a weak draft only the shallow ones pay.
    weak = _measured(2e-4, alpha_hits=1, alpha_misses=9)
    assert 0 < weak.branches([row], [4], 4)[0] < 4


def test_the_branch_rate_is_learnt_and_moves_the_choice():
    row = RowView(1, AUTO_GAMMA, MAX_GAMMA, True)
    controller = _measured(3e-4)
    before = controller.branches([row], [3], 3)[0]
    for _ in range(200):
        controller.observe_branch(False)  # runner-ups never right: β -> 0
    assert controller.branch_rate() < 0.05 and controller.branches([row], [3], 3) == [0] and before > 0
    # Sampled rows keep their own rate: the greedy rows' misses do not reach them.
    sampled = RowView(2, AUTO_GAMMA, MAX_GAMMA, False)
    assert controller.branch_rate(greedy=False) > 0.25 and controller.branches([sampled], [3], 3)[0] > 0


def test_fixed_gives_every_branch_and_the_chain_heuristics_none():
    rows = [RowView(1, 2, MAX_GAMMA, True), RowView(2, AUTO_GAMMA, MAX_GAMMA, True)]
    assert GammaController("fixed", max_gamma=MAX_GAMMA).branches(rows, [2, 4], 3) == [3, 3]
    assert _measured(1e-7).branches(rows, [2, 4], 3) == [0, 3]  # goodput: a fixed gamma stays a chain
    assert GammaController("hf", max_gamma=MAX_GAMMA).branches(rows, [2, 4], 3) == [0, 0]
    assert GammaController("leviathan", max_gamma=MAX_GAMMA).branches(rows, [2, 4], 3) == [0, 0]
    assert GammaController(max_gamma=MAX_GAMMA).branches(rows, [2, 4], 3) == [0, 0]  # nothing measured yet
