"""Keeping a long-running model service's native memory flat.

Two things made a target's and a draft's resident memory grow for as long as they served
(docs/reliability.md, "Soak"), neither of them a leak in our code:

- **Kernel caches keyed by shape.** On a CPU, torch's bfloat16 matmuls go through oneDNN, which keeps
  a compiled primitive per operand shape, and ideep (torch's oneDNN wrapper) keeps its own cache of
  them; both hold up to 1,024 entries by default. Every decode step has new attention shapes (the
  keys grow by a token), so both caches fill for a long time: malloc'd memory still rose minutes
  into a SmolLM2 run. Capped at 16 entries, the same load stops allocating after its first minute
  and runs as fast (docs/benchmarks.md, "Figures behind design choices").
  ``bound_kernel_caches`` sets both capacities; each library reads its variable once, when it
  first builds a kernel, so it runs at start-up, before the model loads.
- **Freed memory glibc keeps.** A forward's temporaries are freed into the heap, and a batch
  bigger than any before leaves a high-water mark the process never gives back (a draft's resident
  size jumped once, minutes into a soak). ``HeapTrimmer`` calls glibc's ``malloc_trim`` every few
  seconds on the service's torch thread, between forwards, so nothing allocates while it runs
  (its cost: docs/benchmarks.md, "Figures behind design choices"), and the resident size follows
  what is really in use. On a C library without ``malloc_trim`` (musl, macOS) it does nothing and
  says so once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from concurrent.futures import Executor

log = logging.getLogger(__name__)

# oneDNN's primitive cache and ideep's cache of them: both default to 1,024 entries.
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int) -> None:
    """Cap the shape-keyed kernel caches at `capacity` entries (0: none are kept). Call it before
    the first matmul of the process; later calls change nothing the libraries have read."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ[name] = str(capacity)


def _malloc_trim():
    """glibc's ``malloc_trim(size_t pad)``, or None on a C library without it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Gives the heap's free pages back to the system every `interval_s` seconds (0: never)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self.trims = 0
        self.seconds = 0.0  # time spent in malloc_trim, all calls

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> None:
        """One ``malloc_trim(0)``: run it where nothing else allocates (the torch thread)."""
        if self._trim is None:
            return
        start = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - start
        self.trims += 1

    async def run(self, executor: Executor) -> None:
        """Trim on `executor` (the service's torch thread) every interval until cancelled."""
        if self.interval_s <= 0:
            return
        if self._trim is None:
            log.info("heap trimming off: this C library has no malloc_trim")
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            await loop.run_in_executor(executor, self.trim)
