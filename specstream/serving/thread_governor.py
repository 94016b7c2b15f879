"""A forward's thread count that follows the CPU time the process actually gets.

The model's forwards run as a team of threads that meet at every layer's joins (~150 a step). On a
quiet host each thread has a core. Beside CPU-bound work the scheduler weighs as an equal of ours —
a busy loop in another session (Linux's autogroup ranks `nice` only within a session) or in another
cgroup — our process gets about half of the cores, and a team of two loses a whole time slice at
every join where one of its threads waits for a core. Measured on SmolLM2's 4-bit step, 2 cores, two
`nice -n 19` loops in another session: 23 ms a step with 2 threads (they ran 30% of the time) against
9.4 ms with 1; quiet, 6.2 ms with 2 (93%) and 9.8 with 1.

So each forward is timed (wall) against the process's CPU time over it. Their ratio per thread is the
team's share of its cores: when it stays under ``STARVED`` for ``WINDOW`` forwards, the team gives up
a thread. With fewer threads than it may run, it tries one more every ``probe_s`` seconds, and keeps
it while that count's share stays above ``STARVED``; a probe given up at once waits twice as long
before the next (up to ``MAX_PROBE_S``), a kept one resets the wait. The kernels' results do not
depend on the thread count (each output feature is computed by one thread, in the same order: tests
check the bits), so changing it changes only the speed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["ThreadGovernor"]

STARVED = 0.55  # a team's CPU share below this: its threads wait for cores (quiet: 0.77-0.93; starved: 0.25-0.30)
WINDOW = 8  # forwards a share is judged over (an exponential mean)
MIN_WALL_S = 5e-4  # shorter forwards are not judged: the clocks' resolution and the hop dominate
PROBE_S = 1.0
MAX_PROBE_S = 4.0  # a failed probe costs WINDOW starved forwards: ~3% of the time at this wait


class ThreadGovernor:
    """Runs forwards on the calling (torch) thread with a thread count between 1 and ``most``."""

    def __init__(self, most: int, clock: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.process_time,
                 set_threads: Callable[[int], None] = torch.set_num_threads, probe_s: float = PROBE_S) -> None:
        if most < 1:
            raise ValueError(f"most={most!r}: must be >= 1")
        self.most = self.threads = most
        self._clock, self._cpu, self._set_threads = clock, cpu, set_threads
        self._set = most  # what the torch thread was last set to (its own count, at first)
        self._share = 1.0  # exponential mean of the current count's CPU share
        self._judged = 0  # forwards judged at the current count
        self.probe_s = self._base_probe_s = probe_s
        self._next_probe = clock() + probe_s
        self._probing = False  # the current count is a probe not yet judged

    def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` with the governor's thread count, timed and judged."""
        if self.threads != self._set:
            self._set_threads(self.threads)
            self._set = self.threads
        wall, cpu = self._clock(), self._cpu()
        try:
            return fn(*args)
        finally:
            self.observe(self._clock() - wall, self._cpu() - cpu)

    def observe(self, wall_s: float, cpu_s: float) -> None:
        """One forward's wall and CPU seconds at the current count: the count for the next one."""
        now = self._clock()
        if wall_s >= MIN_WALL_S:
            share = cpu_s / wall_s / self.threads
            self._share = share if self._judged == 0 else self._share + (share - self._share) * 2 / (WINDOW + 1)
            self._judged += 1
        if self._judged >= WINDOW and self._share < STARVED and self.threads > 1:
            failed = self._probing
            self._change(self.threads - 1, f"its threads ran {self._share:.0%} of the time")
            self.probe_s = min(2 * self.probe_s, MAX_PROBE_S) if failed else self._base_probe_s
            self._next_probe = now + self.probe_s
        elif self._probing and self._judged >= WINDOW:
            self._probing = False  # the probe's count kept its cores
            self.probe_s = self._base_probe_s
            self._next_probe = now + self.probe_s
        elif self.threads < self.most and now >= self._next_probe and not self._probing:
            self._change(self.threads + 1, "a probe")
            self._probing = True

    def _change(self, threads: int, why: str) -> None:
        log.info("forwards on %d thread%s (was %d): %s", threads, "" if threads == 1 else "s", self.threads, why)
        self.threads = threads
        self._share, self._judged, self._probing = 1.0, 0, False
