"""The one thread a service does all its torch work on.

A service's event loop must keep serving gRPC while a model runs, so forwards go to a worker
thread; and ALL torch work (loading the model, allocating the cache, every forward) goes to that
same thread, because on a small CPU, OpenMP thread teams started from two threads compete for the
cores and every forward gets much slower (measured here: 7.4 ms vs 11.8 ms per decode step; on
SmolLM2 with 4-bit weights 18.5 ms vs 38 ms, and the first thread's forwards slow down too once a
second one has run any).

A service makes its own with ``compute_executor``. Code that drives models inside one process
(in-process engines, in-process drafts, benchmarks, training) uses ``torch_thread()``, the
process's shared one, for loading and running alike, and ``on_torch_thread(fn)`` to call a function
there and wait for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
_shared: ThreadPoolExecutor | None = None
_shared_lock = threading.Lock()
_shared_ident: int | None = None  # the shared thread's id, once it runs


def compute_executor(name: str, torch_threads: int = 0) -> ThreadPoolExecutor:
    """A single worker thread; `torch_threads` > 0 sets its intra-op thread count."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_set_threads,
                              initargs=(torch_threads,))


def _set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


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
