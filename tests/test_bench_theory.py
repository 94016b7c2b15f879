"""The theoretical speedup the benchmarks compare against (Leviathan et al. 2023, Thm 3.8)."""

from __future__ import annotations

import pytest

from tools.bench.theory import expected_speedup, expected_tokens_per_pass


def test_worked_value():
    # (1 - 0.8^5) / ((1 - 0.8) * (4 * 0.1 + 1)) = 0.67232 / 0.28
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(2.40114, rel=1e-5)


def test_limits():
    assert expected_speedup(0.0, 4, 0.0) == 1.0  # nothing accepted: one token per pass
    assert expected_speedup(0.7, 0, 0.5) == 1.0  # no speculation
    assert expected_tokens_per_pass(1.0, 4) == 5.0  # everything accepted: gamma + bonus
    assert expected_tokens_per_pass(0.999999, 4) == pytest.approx(5.0, rel=1e-4)


def test_costly_draft_can_make_it_slower():
    assert expected_speedup(0.3, 8, 0.5) < 1.0
