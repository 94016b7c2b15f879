"""Batching policy decisions on their own: admission under static / topup ε, row selection, and
the starvation bound (no model involved)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specstream.data.config import ModelSpec, TargetConfig
from target_service.scheduler import Scheduler


@dataclass(eq=False)
class FakeRow:
    length: int
    last_expanded: int = 0
    width: int = 1  # a beam request's running hypotheses


def _scheduler(**kwargs) -> Scheduler:
    return Scheduler(TargetConfig(model=ModelSpec("m"), **kwargs))


def test_static_admits_only_into_a_drained_batch():
    s = _scheduler(policy="static", max_slots=8, max_batch=4)
    assert s.admissions(running_rows=0, free_slots=8, needs=[1] * 6) == 4  # one batch of n
    assert s.admissions(running_rows=1, free_slots=7, needs=[1] * 6) == 0  # not before every row has finished


@pytest.mark.parametrize("eps,running,expected", [(1.0, 3, 1), (1.0, 4, 0), (0.5, 3, 0), (0.5, 2, 2), (0.0, 1, 0),
                                                  (0.0, 0, 4)])
def test_topup_refills_at_eps_n(eps, running, expected):
    s = _scheduler(policy="topup", refill_threshold=eps, max_slots=4)
    assert s.admissions(running_rows=running, free_slots=4 - running, needs=[1] * 6) == expected


def test_a_beam_is_admitted_whole_and_nothing_overtakes_it():
    s = _scheduler(policy="topup", max_slots=8)
    assert s.admissions(running_rows=0, free_slots=8, needs=[5, 2, 1]) == 3  # 5 + 2 + 1 slots
    assert s.admissions(running_rows=0, free_slots=6, needs=[5, 2, 1]) == 1  # the 2-beam waits for room
    assert s.admissions(running_rows=3, free_slots=4, needs=[5, 1]) == 0  # the 1-row request does not overtake
    static = _scheduler(policy="static", max_slots=16, max_batch=8)
    assert static.admissions(running_rows=0, free_slots=16, needs=[5, 2, 5]) == 2  # 7 of n = 8 rows
    assert static.admissions(running_rows=0, free_slots=16, needs=[10, 1]) == 1  # wider than n: alone


def test_selection_counts_a_beam_as_its_width():
    rows = [FakeRow(10, width=3), FakeRow(10, width=5), FakeRow(10), FakeRow(11, width=2)]
    assert _scheduler(max_slots=16, max_batch=4).select(rows, 1) == [rows[0], rows[2]]  # 3 + 1; the 5 does not fit
    assert _scheduler(max_slots=16, max_batch=4, row_selection="min_length").select(rows, 1) == [rows[0], rows[2]]
    assert _scheduler(max_slots=16, max_batch=4, row_selection="fifo").select(rows, 1) == [rows[3], rows[2]]
    assert _scheduler(max_slots=16, max_batch=3).select(rows[1:], 1) == [rows[1]]  # wider than n: alone


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
            row.length += 1 + step % 3  # rows grow by different amounts, as under speculation
        assert all(step - row.last_expanded <= 3 + 3 for row in rows)  # max_wait_steps + ceil(6 rows / 2)
