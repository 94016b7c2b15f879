"""Keeps `specstream serve`'s draft and target processes running (docs/architecture.md §9, Supervision).

A thread polls the children every `poll_s`. A draft or target that exited is started again on its
old address with its old arguments, after a delay: `initial_delay_s` after its first crash, twice
the previous one after each further crash, at most `max_delay_s`; a process that has stayed up
`stable_s` is forgiven and its next crash waits `initial_delay_s` again. Every exit and restart is
reported. The process named `final` (the gateway) is never restarted: its exit ends supervision,
and `final_exit` holds its exit code for `serve` to return.

Nothing else needs to know: the target reconnects to a restarted draft by itself, and the gateway
to a restarted target. Knows nothing about what the processes do; `respawn(name)` starts one.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specstream.data.config import RestartPolicy

log = logging.getLogger(__name__)


@dataclass
class _Child:
    started: float  # monotonic time it was (re)started
    delay: float  # the wait before restarting it after its next exit
    due: float | None = None  # when a pending restart is due
    restarts: int = 0


class Supervisor:
    def __init__(self, procs: dict[str, subprocess.Popen], respawn: Callable[[str], None], policy: RestartPolicy,
                 final: str = "gateway", report: Callable[[str], None] = log.warning, poll_s: float = 0.1) -> None:
        self.procs = procs  # shared with the owner, which replaces entries as processes restart
        self.respawn = respawn
        self.policy = policy
        self.final = final
        self.report = report
        self.poll_s = poll_s
        self.lock = threading.Lock()  # held while children are inspected or started; the owner takes it to change them
        self.final_exit: int | None = None
        self._children: dict[str, _Child] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self._children.items()}

    def start(self) -> None:
        now = time.monotonic()
        self._children = {name: _Child(now, self.policy.initial_delay_s) for name in self.procs}
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops watching (before the owner stops the children, so none is restarted meanwhile)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self.lock:
                if self._stop.is_set() or not self._check(time.monotonic()):
                    return

    def _check(self, now: float) -> bool:
        """One look at every child; False once the final process has exited."""
        for name, proc in list(self.procs.items()):
            child = self._children.setdefault(name, _Child(now, self.policy.initial_delay_s))
            code = proc.poll()
            if code is None:
                if child.due is not None:  # started again by the owner (Stack.restart)
                    child.due, child.started = None, now
                if now - child.started >= self.policy.stable_s:
                    child.delay = self.policy.initial_delay_s
                continue
            if name == self.final:
                self.final_exit = code
                self.report(f"{name} exited with code {code}; stopping the others")
                return False
            if child.due is None:
                child.due = now + child.delay
                self.report(f"{name} exited with code {code}; restarting it in {child.delay:.1f}s")
            elif now >= child.due:
                self.respawn(name)
                child.restarts += 1
                child.started, child.due = now, None
                child.delay = min(child.delay * 2.0, self.policy.max_delay_s)
                self.report(f"restarted {name} (pid {self.procs[name].pid}; restart {child.restarts})")
        return True
