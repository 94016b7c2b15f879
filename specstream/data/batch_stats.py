"""Per-run batching counters of the target engine (docs/architecture.md §10, "Batching policies"):
steps, row expansions, tokens processed, padding, batch occupancy (mean and histogram, overall and
while requests were waiting) and queue time. Cumulative since the service started;
specstream/data/engine_wire.py writes them as protobuf."""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass, field


@dataclass
class BatchStats:
    policy: str
    max_batch: int
    steps: int = 0  # decode steps (one verify forward each)
    row_expansions: int = 0  # rows expanded, summed over steps
    tokens_processed: int = 0  # real positions fed to verify forwards (last token + proposals)
    padded_tokens: int = 0  # positions fed only to make rows equally long
    prefill_tokens: int = 0  # prompt tokens prefilled
    queued_steps: int = 0  # decode steps taken while sequences were waiting for a slot
    queued_rows: int = 0  # rows expanded in those steps
    admitted: int = 0
    queue_seconds: float = 0.0  # summed over admitted sequences
    occupancy: list[int] = field(default_factory=list)  # occupancy[k]: steps that expanded k rows

    def __post_init__(self) -> None:
        self.occupancy = [0] * (self.max_batch + 1)

    def record_step(self, rows: int, width: int, tokens: int, waiting: int) -> None:
        """A verify forward over `rows` rows of `width` positions, `tokens` of them real."""
        self.steps += 1
        self.row_expansions += rows
        self.tokens_processed += tokens
        self.padded_tokens += rows * width - tokens
        self.occupancy[min(rows, self.max_batch)] += 1
        if waiting:
            self.queued_steps += 1
            self.queued_rows += rows

    def record_admission(self, queue_seconds: float) -> None:
        self.admitted += 1
        self.queue_seconds += queue_seconds

    def snapshot(self) -> BatchStats:
        """A copy that later steps do not change."""
        copy = _copy.copy(self)
        copy.occupancy = list(self.occupancy)
        return copy
