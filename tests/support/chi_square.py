"""Chi-square tests for the sampling suites: two samples from one distribution, and a sample
against exact probabilities. Each returns a p-value; the suites fail below their stated threshold."""

from __future__ import annotations

from collections import Counter

import torch


def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularized upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two equally large samples come from one distribution. Cells with
    fewer than 10 observations in both together (5 expected in each) are pooled into one."""
    assert sum(a.values()) == sum(b.values())
    cells, rare_a, rare_b = [], 0, 0
    for cell in set(a) | set(b):
        if a[cell] + b[cell] >= 10:
            cells.append((a[cell], b[cell]))
        else:
            rare_a, rare_b = rare_a + a[cell], rare_b + b[cell]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return _chi2_sf(stat, len(cells) - 1)


def goodness_of_fit_p_value(observed: Counter, probs: list[float]) -> float:
    """Chi-square test of a sample against exact probabilities; cells expecting < 5 are pooled."""
    n = sum(observed.values())
    assert all(probs[token] > 0 for token in observed), "a token the distribution rules out was drawn"
    cells, rare_obs, rare_exp = [], 0, 0.0
    for token, p in enumerate(probs):
        if n * p >= 5:
            cells.append((observed[token], n * p))
        else:
            rare_obs, rare_exp = rare_obs + observed[token], rare_exp + n * p
    if rare_exp:
        cells.append((rare_obs, rare_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return _chi2_sf(stat, len(cells) - 1)
