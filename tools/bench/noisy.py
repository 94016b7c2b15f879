"""A noisy host: low-priority CPU-bound neighbours beside the served stack.

A user's server shares its cores with other work: a batch job at `nice -n 19`, a build, another
pod. Plain decoding should keep most of its quiet speed beside such a neighbour (the goal: at
least 0.9x). Measured through the served stack (three processes, the client timing each request),
because that is where a neighbour hurts: every token crosses processes and threads, and each
hand-over waits for a core.

What we learnt (docs/benchmarks.md, "A noisy host"): Linux schedules each session as one group
(autogroup, on by default) and `nice` only ranks processes within a group. The launcher used to
start each service in a session of its own, so a nice-19 loop beside it got an equal share and
plain decoding fell to 0.15x; in the caller's session (a process group of their own, for Ctrl-C)
the services keep their speed. A neighbour in another session or another cgroup (a Kubernetes
pod) is weighted by the kernel as an equal, whatever its nice value: there the thread count must
fit the CPU share the service has (specstream.serving.compute reads the cgroup's CPU quota).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tools.bench.latency import sweep
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec

PROMPTS = 3
NEW_TOKENS = 64


@contextmanager
def noisy_neighbours(count: int | None = None) -> Iterator[None]:
    """One low-priority busy loop per core (``nice -n 19``) for the duration of the block, in this
    process's session."""
    count = count or os.cpu_count() or 1
    loops = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them take the cores
        yield
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


def served_decoding(models: BenchModels, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS,
                    rounds: int = 2) -> dict[str, float]:
    """Tokens/s of plain greedy decoding through a served stack (batch 1, client-timed): quiet and
    beside the busy loops in turns (quiet, noisy, quiet, ..., quiet: ``rounds`` noisy spells, so a
    shared machine's drift falls on both), and the mean noisy speed ÷ the mean quiet speed."""
    chosen = models.prompts(prompts)
    quiet, noisy = [], []
    with tempfile.TemporaryDirectory() as logs, \
            Stack(StackSpec(**models.stack_fields(speculative=False), log_dir=logs)) as stack:
        sweep(stack.gateway_address, chosen[:1], [0], new_tokens)  # warm-up
        for i in range(2 * rounds + 1):
            if i % 2:
                with noisy_neighbours():
                    noisy.append(sweep(stack.gateway_address, chosen, [0], new_tokens)[0]["tokens_per_s"])
            else:
                quiet.append(sweep(stack.gateway_address, chosen, [0], new_tokens)[0]["tokens_per_s"])
    mean_quiet, mean_noisy = sum(quiet) / len(quiet), sum(noisy) / len(noisy)
    return {"quiet": mean_quiet, "noisy": mean_noisy, "quiet_runs": quiet, "noisy_runs": noisy,
            "noisy_over_quiet": mean_noisy / mean_quiet}
