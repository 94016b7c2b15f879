"""Recursive least squares with exponential forgetting, the online fit behind the γ controller's
cost model (target_service/cost_model.py) and the draft round trip's deadline
(target_service/draft_deadline.py). Knows nothing about what it fits: features in, a value out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LinearFit"]


class LinearFit:
    """Recursive least squares with exponential forgetting: y ≈ θ·x, refit on every sample.

    The prior is θ0 with covariance diag(prior_var): a small variance on a slope keeps it near its
    prior until the samples tell it apart from the intercept (the first steps all have one size)."""

    def __init__(self, theta0: Sequence[float], prior_var: Sequence[float], forget: float = 0.995) -> None:
        self.theta = np.array(theta0, dtype=np.float64)  # [F]
        self.values: tuple[float, ...] = tuple(self.theta.tolist())  # θ as Python floats: read every step
        self.P0 = np.diag(np.array(prior_var, dtype=np.float64))  # [F, F]
        self.P = self.P0.copy()  # [F, F] covariance of θ over the noise variance
        self.forget = forget
        self.samples = 0

    def seed(self, index: int, value: float) -> None:
        """Sets θ[index] as if it were the prior's (its variance unchanged)."""
        self.theta[index] = value
        self.values = tuple(self.theta.tolist())

    def observe(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, dtype=np.float64)  # [F]
        Px = self.P @ x  # [F]
        gain = Px / (self.forget + x @ Px)  # [F]
        self.theta = self.theta + gain * (y - x @ self.theta)
        self.values = tuple(self.theta.tolist())
        self.P = (self.P - np.outer(gain, Px)) / self.forget
        # Forgetting inflates P along directions no sample excites (a constant size, say); never
        # beyond the prior, or a long steady run would make the next new size swing θ wildly.
        scale = np.trace(self.P) / np.trace(self.P0)
        if scale > 1.0:
            self.P /= scale
        self.samples += 1
