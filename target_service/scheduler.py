"""Batching policy of the target engine (docs/architecture.md §4, Admit): when to admit waiting sequences, and which
running rows to expand in a step.

- `static` (VAR-BATCH, the baseline): admit a batch only once the previous one has drained.
- `topup` with refill threshold ε (Marian's top-up; ε = 1 is continuous batching): admit into free
  slots whenever at most ε·n rows are running.
- Row selection, when more rows are running than one step expands (n = `max_batch`): `all` (oldest
  first), `min_length` (VAR-STREAM: only rows at, or within `min_length_slack` of, the shortest
  length, so padding and attention cost stay low) or `fifo` (VAR-STR-FIFO: longest first). Under
  every selection a row left out for `max_wait_steps` consecutive steps goes first, longest wait
  first: the starvation bound (no row waits more than max_wait_steps + ⌈resident rows / n⌉ steps).

A beam request is one group of up to k rows (its running hypotheses, all of one length): it is
admitted whole (k slots, Algorithm 1 of the VAR-STREAM paper), selected whole, and counts its
width against n; an ordinary request is a group of one row. A beam's length for min_length and
fifo is the paper's l_t, the tokens generated: prompts of different lengths would otherwise
expand one beam at a time.

Knows sequences only by their lengths, widths and step counters; nothing about models or gRPC.
Which rows share a step never changes any row's tokens (masking makes each row's forward
independent).
"""

from __future__ import annotations

from typing import Protocol

from specstream.data.config import TargetConfig


class Schedulable(Protocol):
    """What the scheduler selects: a running sequence, or a beam request's group of hypotheses."""

    last_expanded: int  # the step the row was last expanded (or admitted)

    @property
    def length(self) -> int: ...  # tokens so far (prompt + generated); a beam: tokens generated (l_t)

    @property
    def width(self) -> int: ...  # rows it takes in a step (a beam's running hypotheses; 1 otherwise)


class Scheduler:
    def __init__(self, config: TargetConfig) -> None:
        self.config = config
        self.batch = config.batch_rows  # n: rows expanded per step

    def admissions(self, running_rows: int, free_slots: int, needs: list[int]) -> int:
        """How many of the waiting sequences (oldest first; `needs[i]`: the slots, and rows, the
        i-th takes) may start this step, given `running_rows` rows resident. A group that does not
        fit stops admission: nothing overtakes the oldest."""
        if self.config.policy == "static":
            if running_rows:
                return 0
            rows = self.batch
        elif running_rows <= self.config.refill_threshold * self.batch:
            rows = free_slots
        else:
            return 0
        count = 0
        for need in needs:
            if need > free_slots or (need > rows and count):
                break
            free_slots -= need
            rows -= need
            count += 1
        return count

    def select(self, rows: list[Schedulable], step: int) -> list[Schedulable]:
        """The groups to expand this step (n rows at most, unless one group alone is wider), from
        `rows` in admission order."""
        if sum(r.width for r in rows) <= self.batch and self.config.row_selection == "all":
            return rows
        starving = sorted((r for r in rows if step - r.last_expanded >= self.config.max_wait_steps),
                          key=lambda r: r.last_expanded)  # longest wait first
        if self.config.row_selection == "min_length":
            shortest = min(r.length for r in rows)
            near = [r for r in rows if r.length <= shortest + self.config.min_length_slack]
            order = sorted(near, key=lambda r: r.length)
        elif self.config.row_selection == "fifo":
            order = sorted(rows, key=lambda r: -r.length)  # stable: oldest first among equals
        else:
            order = rows
        chosen: dict[Schedulable, None] = {}
        used = 0
        for row in [*starving, *order]:
            if row in chosen:
                continue
            if used + row.width > self.batch and chosen:
                if used >= self.batch:
                    break
                continue  # too wide for what is left: a narrower group may fit
            chosen[row] = None
            used += row.width
        return list(chosen)
