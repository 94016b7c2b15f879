"""Batching policy decisions on their own: admission under static / topup ε, row selection, and
the starvation bound (no model involved)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specstream.config import ModelSpec, TargetConfig
from target_service.scheduler import Scheduler


@dataclass(eq=False)
class FakeRow:
    length: int
    last_expanded: int = 0
    tokens: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = [0] * self.length


def _scheduler(**kwargs) -> Scheduler:
    return Scheduler(TargetConfig(model=ModelSpec("m"), **kwargs))


def test_static_admits_only_into_a_drained_batch():
    s = _scheduler(policy="static", max_slots=8, max_batch=4)
    assert s.admissions(running=0, free_slots=8) == 4  # one batch of n
    assert s.admissions(running=1, free_slots=7) == 0  # not before every row has finished


@pytest.mark.parametrize("eps,running,expected", [(1.0, 3, 1), (1.0, 4, 0), (0.5, 3, 0), (0.5, 2, 2), (0.0, 1, 0),
                                                  (0.0, 0, 4)])
def test_topup_refills_at_eps_n(eps, running, expected):
    s = _scheduler(policy="topup", refill_threshold=eps, max_slots=4)
    assert s.admissions(running=running, free_slots=4 - running) == expected


def test_selection_all_min_length_fifo():
    rows = [FakeRow(10), FakeRow(7), FakeRow(12), FakeRow(7), FakeRow(8)]  # admission order
    assert _scheduler(max_slots=8, max_batch=3).select(rows, 1) == rows[:3]
    assert _scheduler(max_slots=8, row_selection="all").select(rows, 1) == rows
    assert _scheduler(max_slots=8, max_batch=3, row_selection="min_length").select(rows, 1) == [rows[1], rows[3]]
    slack = _scheduler(max_slots=8, max_batch=3, row_selection="min_length", min_length_slack=1).select(rows, 1)
    assert slack == [rows[1], rows[3], rows[4]]
    assert _scheduler(max_slots=8, max_batch=3, row_selection="fifo").select(rows, 1) == [rows[2], rows[0], rows[4]]


@pytest.mark.parametrize("selection", ["all", "min_length", "fifo"])
def test_starvation_bound(selection):
    """Replaying the engine's bookkeeping: no row waits max_wait_steps steps, however lengths move."""
    s = _scheduler(max_slots=8, max_batch=2, row_selection=selection, max_wait_steps=3)
    rows = [FakeRow(5 + i) for i in range(6)]
    for step in range(1, 60):
        chosen = s.select(rows, step)
        assert 1 <= len(chosen) <= 2
        for row in chosen:
            row.last_expanded = step
            row.tokens += [0] * (1 + step % 3)  # rows grow by different amounts, as under speculation
        assert all(step - row.last_expanded <= 3 + 3 for row in rows)  # max_wait_steps + ceil(6 rows / 2)
