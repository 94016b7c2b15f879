"""Leviathan et al. (2023), the expected speedup of speculative decoding.

With acceptance rate α (each proposal accepted independently), γ proposals per step and cost
ratio c = (time of one draft step) / (time of one target step), one target pass yields on average
(1 − α^(γ+1)) / (1 − α) tokens (Thm 3.8's numerator) and costs γc + 1 target-step times.
"""

from __future__ import annotations


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan Thm 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + 1)); 1.0 at γ = 0."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1.0)
