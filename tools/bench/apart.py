"""A benchmark function run in a Python process of its own: ``run_apart(function, **kwargs)``.

For measurements that must not share a process with the benchmark's torch thread: llama.cpp's
thread pool beside torch's OpenMP team ran up to twice as slow, and a second thread's torch work
(inductor's compile threads) slows the torch thread afterwards (docs/architecture.md §7.4).
``function`` is importable (``module.qualname``); ``kwargs`` and its result travel as JSON (a
dict's integer keys come back as strings).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

__all__ = ["run_apart"]

_CODE = ("import importlib, json, sys; job = json.load(sys.stdin); "
         "fn = getattr(importlib.import_module(job['module']), job['name']); "
         "print(json.dumps(fn(**job['kwargs'])))")


def run_apart(function: Callable, **kwargs):
    """``function(**kwargs)`` in a fresh interpreter; its JSON result (the last line it prints)."""
    job = json.dumps({"module": function.__module__, "name": function.__qualname__, "kwargs": kwargs})
    done = subprocess.run([sys.executable, "-c", _CODE], input=job, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
