"""The γ controller tests' simulated engine: known acceptance α per token, known costs.

A simulated step: each row's proposals are accepted one by one with probability α until the first
rejection; the step costs verify(positions) + draft(depth, proposals), positions = rows × (depth + 1)
as in the engine, whose verify forward pads every row to the deepest. The analytic batch-1 optimum is
Leviathan et al.'s argmax_γ (1 − α^(γ+1)) / ((1 − α)(γc + 1)), written out here independently of
the controller's code.
"""

from __future__ import annotations

import random

from target_service.gamma import AUTO_GAMMA, GammaController, RowView

MAX_GAMMA = 16


def analytic_optimum(alpha: float, c: float, cap: int = MAX_GAMMA) -> int:
    def speedup(g: int) -> float:
        return (1 - alpha ** (g + 1)) / ((1 - alpha) * (g * c + 1))
    return max(range(cap + 1), key=speedup)


class SimulatedEngine:
    """rows sequences with acceptance alpha(step, row); costs in seconds."""

    def __init__(self, controller: GammaController, rows: int, verify, draft, seed: int = 0) -> None:
        self.controller, self.rows, self.verify, self.draft = controller, rows, verify, draft
        self.rng = random.Random(seed)
        self.chosen: list[list[int]] = []
        self.committed = 0
        self.seconds = 0.0

    def step(self, alpha: float, greedy: bool = True) -> list[int]:
        views = [RowView(i, AUTO_GAMMA, MAX_GAMMA, greedy) for i in range(self.rows)]
        gammas = self.controller.choose(views, [MAX_GAMMA] * self.rows)
        for i, g in enumerate(gammas):
            k = 0
            while k < g and self.rng.random() < alpha:
                k += 1
            self.controller.observe(i, "model", greedy, g, k)
            self.committed += k + 1
        depth, proposals = max(gammas), sum(gammas)
        verify_s, draft_s = self.verify(self.rows * (depth + 1)), self.draft(depth, proposals) if proposals else 0.0
        self.controller.observe_step(self.rows, depth, proposals, verify_s, draft_s, 0.0)
        self.seconds += verify_s + draft_s
        self.chosen.append(gammas)
        return gammas
