"""Batching policy of the target engine (design §4): when to admit waiting sequences, and which
running rows to expand in a step.

- `static` (VAR-BATCH, the baseline): admit a batch only once the previous one has drained.
- `topup` with refill threshold ε (Marian's top-up; ε = 1 is continuous batching): admit into free
  slots whenever at most ε·n rows are running.
- Row selection, when more rows are running than one step expands (n = `max_batch`): `all` (oldest
  first), `min_length` (VAR-STREAM: only rows at, or within `min_length_slack` of, the shortest
  length, so padding and attention cost stay low) or `fifo` (VAR-STR-FIFO: longest first). Under
  every selection a row left out for `max_wait_steps` consecutive steps goes first, longest wait
  first: the starvation bound (no row waits more than max_wait_steps + ⌈resident rows / n⌉ steps).

Knows sequences only by their lengths and step counters; nothing about models or gRPC. Which rows
share a step never changes any row's tokens (masking makes each row's forward independent).
"""

from __future__ import annotations

from typing import Protocol

from specstream.config import TargetConfig


class Row(Protocol):
    tokens: list[int]
    last_expanded: int  # the step the row was last expanded (or admitted)


class Scheduler:
    def __init__(self, config: TargetConfig) -> None:
        self.config = config
        self.batch = config.batch_rows  # n: rows expanded per step

    def admissions(self, running: int, free_slots: int) -> int:
        """How many waiting sequences may start this step, given `running` resident sequences."""
        if self.config.policy == "static":
            return min(free_slots, self.batch) if running == 0 else 0
        if running <= self.config.refill_threshold * self.batch:
            return free_slots
        return 0

    def select(self, rows: list[Row], step: int) -> list[Row]:
        """The rows to expand this step (at most n), from `rows` in admission order."""
        if len(rows) <= self.batch and self.config.row_selection == "all":
            return rows
        starving = sorted((r for r in rows if step - r.last_expanded >= self.config.max_wait_steps),
                          key=lambda r: r.last_expanded)  # longest wait first
        if self.config.row_selection == "min_length":
            shortest = min(len(r.tokens) for r in rows)
            near = [r for r in rows if len(r.tokens) <= shortest + self.config.min_length_slack]
            order = sorted(near, key=lambda r: len(r.tokens))
        elif self.config.row_selection == "fifo":
            order = sorted(rows, key=lambda r: -len(r.tokens))  # stable: oldest first among equals
        else:
            order = rows
        chosen = dict.fromkeys(starving[: self.batch])
        for row in order:
            if len(chosen) >= self.batch:
                break
            chosen.setdefault(row)
        return list(chosen)
