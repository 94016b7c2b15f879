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
The benchmark runs the loops both ways (``SESSIONS``), and llama.cpp beside the other session's.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tools.bench.apart import run_apart
from tools.bench.latency import llama_cpp_available, llama_cpp_runs, sweep
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec

PROMPTS = 3
NEW_TOKENS = 64
# Where the busy loops run: in this process's session (a job of the same user's shell, ranked by
# nice) or in a session of their own (a cron job, another terminal's build: the kernel's autogroup
# weighs that session as an equal of ours, whatever its nice value).
SESSIONS = ("ours", "other")


@contextmanager
def noisy_neighbours(count: int | None = None, session: str = "ours") -> Iterator[None]:
    """One low-priority busy loop per core (``nice -n 19``) for the duration of the block, in this
    process's session or (``session="other"``) in a session of their own."""
    if session not in SESSIONS:
        raise ValueError(f"session={session!r}: must be one of {SESSIONS}")
    count = count or os.cpu_count() or 1
    loops = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"],
                              start_new_session=session == "other") for _ in range(count)]
    try:
        time.sleep(0.5)  # let them take the cores
        yield
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


def served_decoding(models: BenchModels, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS,
                    rounds: int = 2) -> dict:
    """Tokens/s of plain greedy decoding through a served stack (batch 1, client-timed): quiet and
    beside the busy loops in turns (quiet, loops, quiet, ..., quiet: ``rounds`` spells of loops in
    our session and as many in another session, so a shared machine's drift falls on all three),
    each mean ÷ the mean quiet speed. A second stack whose target keeps its thread count fixed
    (``--fixed-threads``) takes the same turns, quiet and beside the other session's loops (the
    two stacks going first in turn). With llama.cpp installed, its plain decoding of the same
    prompts in a process of its own, quiet and beside the other session's loops, in turns too."""
    chosen = models.prompts(prompts)
    runs: dict[str, list[float]] = {"quiet": [], "ours": [], "other": [], "fixed quiet": [], "fixed other": []}
    fields = models.stack_fields(speculative=False)
    with tempfile.TemporaryDirectory() as logs, tempfile.TemporaryDirectory() as fixed_logs, \
            Stack(StackSpec(**fields, log_dir=logs)) as stack, \
            Stack(StackSpec(**fields, extra_target_args=["--fixed-threads"], log_dir=fixed_logs)) as fixed:
        for address in (stack.gateway_address, fixed.gateway_address):
            sweep(address, chosen[:1], [0], new_tokens)  # warm-up
        for i in range(4 * rounds + 1):
            session = SESSIONS[i // 2 % 2] if i % 2 else None  # the two kinds of neighbour take turns
            key = session or "quiet"
            turns = [(key, stack)] + ([("fixed " + key, fixed)] if session != "ours" else [])
            if len(runs[key]) % 2:  # the stacks go first in turn, spell by spell of each kind
                turns.reverse()
            with noisy_neighbours(session=session) if session else contextlib.nullcontext():
                for key, which in turns:
                    runs[key].append(sweep(which.gateway_address, chosen, [0], new_tokens)[0]["tokens_per_s"])
    means = {k: sum(v) / len(v) for k, v in runs.items()}
    out = {"quiet": means["quiet"], "noisy": means["ours"], "other_session": means["other"],
           "quiet_runs": runs["quiet"], "noisy_runs": runs["ours"], "other_session_runs": runs["other"],
           "noisy_over_quiet": means["ours"] / means["quiet"],
           "other_session_over_quiet": means["other"] / means["quiet"],
           "fixed_threads": {"quiet": means["fixed quiet"], "other_session": means["fixed other"],
                             "quiet_runs": runs["fixed quiet"], "other_session_runs": runs["fixed other"],
                             "other_session_over_quiet": means["fixed other"] / means["fixed quiet"]},
           "other_session_over_fixed_threads": means["other"] / means["fixed other"]}
    if llama_cpp_available(models):
        peer: dict[str, list[float]] = {"quiet": [], "other": []}
        for i in range(2 * rounds + 1):
            label = "other" if i % 2 else "quiet"
            with noisy_neighbours(session="other") if label == "other" else contextlib.nullcontext():
                done = run_apart(llama_cpp_runs, gguf=str(models.gguf), prompts=chosen, max_new_tokens=new_tokens,
                                 modes=("plain",))
            peer[label].append(done["plain"]["tokens_per_s"])
        out["llama_cpp"] = sum(peer["quiet"]) / len(peer["quiet"])
        out["llama_cpp_other_session"] = sum(peer["other"]) / len(peer["other"])
        out["llama_cpp_runs"], out["llama_cpp_other_session_runs"] = peer["quiet"], peer["other"]
        out["other_session_over_llama_cpp"] = means["other"] / out["llama_cpp_other_session"]
    return out
