"""The step-progress watchdog of one target replica: has it gone silent while it owes us work?

A target sends a `TargetMessage` (with its Load) on every engine step, and its engine steps
whenever it holds anything, so while the gateway has requests outstanding on a replica, silence
longer than a few steps means the target is hung (stopped, wedged, or its host gone) — long before
TCP or keepalive would say so. The watchdog measures each *silence* (time from the later of the
previous message and the moment the replica became busy, to the next message) while busy, and
declares the replica stalled when the current silence exceeds

    deadline = min(ceiling_s, max(floor_s, step_multiple * p99 of the last `window` silences))

(`specstream.data.config.StallConfig`). Before any silence is measured the deadline is `ceiling_s`.

Plain bookkeeping on timestamps handed in by the caller: knows nothing about gRPC, requests or
what is done with a stalled replica (gateway/target_client.py acts on it).
"""

from __future__ import annotations

import math
from collections import deque

from specstream.data.config import StallConfig


class StepWatchdog:
    def __init__(self, config: StallConfig, window: int = 512) -> None:
        self.config = config
        self._silences: deque[float] = deque(maxlen=window)  # seconds, measured while busy
        self._busy_since: float | None = None  # when the gateway's outstanding work on it went from 0 to 1
        self._last_heard: float | None = None  # when its latest message arrived

    @property
    def busy(self) -> bool:
        return self._busy_since is not None

    def work_started(self, now: float) -> None:
        """The gateway's requests on the replica went from none to some."""
        if self._busy_since is None:
            self._busy_since = now

    def work_ended(self) -> None:
        """None of the gateway's requests are on the replica any more."""
        self._busy_since = None

    def heard(self, now: float) -> None:
        """A message arrived from the replica."""
        if self._busy_since is not None:
            self._silences.append(self.silence(now))
        self._last_heard = now

    def reset(self) -> None:
        """A new stream: nothing outstanding, nothing heard on it yet (measured silences stay:
        they describe the replica's step times)."""
        self._busy_since = self._last_heard = None

    def silence(self, now: float) -> float:
        """How long a busy replica has been silent (0 when it is not busy)."""
        if self._busy_since is None:
            return 0.0
        since = self._busy_since if self._last_heard is None else max(self._last_heard, self._busy_since)
        return max(now - since, 0.0)

    def deadline(self) -> float:
        c = self.config
        if not self._silences:
            return c.ceiling_s
        ranked = sorted(self._silences)
        p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
        return min(c.ceiling_s, max(c.floor_s, c.step_multiple * p99))

    def stalled(self, now: float) -> bool:
        return self.silence(now) > self.deadline()
