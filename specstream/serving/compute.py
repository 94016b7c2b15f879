"""The one thread a service does all its torch work on.

A service's event loop must keep serving gRPC while a model runs, so forwards go to a worker
thread; and ALL torch work (loading the model, allocating the cache, every forward) goes to that
same thread, because on a small CPU, OpenMP thread teams started from two threads compete for the
cores and every forward gets much slower, the first thread's too once a second one has run any
(docs/benchmarks.md, "Figures behind design choices").

A service makes its own with ``compute_executor``; a service whose event loop thread may be its
torch thread (the draft service, unless it works ahead: its loop has nothing else to do while a
proposal is computed) takes an ``InlineExecutor``, which runs each call at once on the calling
thread, saving the hop to a worker and back on every draft call. Code that drives models inside one process
(in-process engines, in-process drafts, benchmarks, training) uses ``torch_thread()``, the
process's shared one, for loading and running alike, and ``on_torch_thread(fn)`` to call a function
there and wait for it. ``run_at_idle_priority`` runs optional work (a draft working ahead) on the
calling thread at the lowest CPU priority.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)
_shared: ThreadPoolExecutor | None = None
_shared_lock = threading.Lock()
_shared_ident: int | None = None  # the shared thread's id, once it runs


def compute_executor(name: str, torch_threads: int = 0) -> ThreadPoolExecutor:
    """A single worker thread; `torch_threads` > 0 sets its intra-op thread count, 0 takes one per
    core this process may use (``cpu_share``)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_set_threads,
                              initargs=(torch_threads,))


class InlineExecutor(Executor):
    """Runs each submitted call at once, on the thread that submits it (which becomes the
    service's torch thread: its intra-op thread count is set here, as ``compute_executor`` sets
    its worker's). ``loop.run_in_executor`` then returns the call's result without a thread hop."""

    def __init__(self, torch_threads: int = 0) -> None:
        _set_threads(torch_threads)

    def submit(self, fn: Callable[..., T], /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller, as a worker would
            future.set_exception(exc)
        return future


def core_beside_model(device: torch.device | str, torch_threads: int = 0) -> bool:
    """Whether a core is left free beside the model's forwards for other work of the process: the
    model on an accelerator, or fewer model threads (``torch_threads``; 0: one per core) than the
    cores this process may use (``cpu_share``)."""
    return str(device) != "cpu" or 0 < torch_threads < cpu_share()


def _set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)
    elif (share := cpu_share()) < torch.get_num_threads():
        torch.set_num_threads(share)


def cpu_name() -> str:
    """The CPU's model name and its class (AVX-512 BF16, AVX2, and AMX where present)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}{', AMX' if 'amx_bf16' in flags else ''})"


def cpu_share(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (a
    Kubernetes CPU limit), rounded down, at least 1. A thread team larger than the quota is stopped
    as a whole every period once the quota is spent, and every forward waits for its slowest thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root, proc_cgroup)
    return max(1, min(cores, math.floor(quota))) if quota is not None else max(1, cores)


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """CPUs per period from cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us``, the tightest
    along the process's cgroup path; None when unlimited or unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, parts = root, Path(path).parts[1:]
            for depth in range(len(parts) + 1):
                quotas.append(_v2_quota(base.joinpath(*parts[:depth]) / "cpu.max"))
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu,cpuacct", root / "cpu"):
                if mount.is_dir():
                    own = mount / path.lstrip("/")
                    quotas.append(_v1_quota(own if own.is_dir() else mount))
                    break
    limits = [q for q in quotas if q is not None]
    return min(limits) if limits else None


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(mount: Path) -> float | None:
    try:
        quota = int((mount / "cpu.cfs_quota_us").read_text())
        period = int((mount / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def torch_thread() -> ThreadPoolExecutor:
    """This process's shared torch thread (created on first use, torch's default thread count)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch", initializer=_mark_shared)
        return _shared


def _mark_shared() -> None:
    global _shared_ident
    _shared_ident = threading.get_ident()


def on_torch_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run on ``torch_thread()``; waits for it (re-entrant: on that thread it
    just calls)."""
    if threading.get_ident() == _shared_ident:
        return fn(*args, **kwargs)
    return torch_thread().submit(fn, *args, **kwargs).result()


def run_at_idle_priority(work: Callable[[], None], idle: bool) -> None:
    """Runs ``work()`` on the calling thread, at ``SCHED_IDLE`` while it runs when ``idle`` (and
    the OS has it, and the thread may go back: ``may_leave_idle``; else at its own policy, said
    once), then back at the thread's own policy. A failure of the work is logged, not raised: the
    work is optional, and the next request is answered from scratch."""
    policy = os.sched_getscheduler(0) if idle and hasattr(os, "SCHED_IDLE") and _idle_allowed() else None
    try:
        if policy is not None:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        work()
    except Exception:  # working ahead must never take the draft (or the target it runs in) down
        log.exception("working ahead failed; the next round is drafted when it is asked for")
    finally:
        if policy is not None:
            os.sched_setscheduler(0, policy, os.sched_param(0))


def may_leave_idle() -> bool:
    """Whether this thread could go back from ``SCHED_IDLE`` to ``SCHED_OTHER`` at its nice value:
    as root (CAP_SYS_NICE), or where RLIMIT_NICE allows that nice value (sched(7): an
    unprivileged thread at SCHED_IDLE may leave it only so). The default limit (0) allows no
    nice value at all: without this check a thread would stay at SCHED_IDLE for good."""
    import resource

    if os.geteuid() == 0:
        return True
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


_idle_checked: bool | None = None


def _idle_allowed() -> bool:
    global _idle_checked
    if _idle_checked is None:
        _idle_checked = may_leave_idle()
        if not _idle_checked:
            log.warning("working ahead at its own priority, not at SCHED_IDLE: this process could not leave "
                        "SCHED_IDLE again (not root, and RLIMIT_NICE allows no nice value of its threads)")
    return _idle_checked
