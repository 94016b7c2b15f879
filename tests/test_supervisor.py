"""The supervisor (tools/supervisor.py) on stand-in child processes: a dead child is started
again after its delay, the delay doubles with each crash up to the cap and is forgiven once the
child stays up; the final child's exit ends supervision with its code; nothing is restarted after
`stop`. (The real stack under supervision: tests/integration/test_draft_faults.py.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specstream.data.config import RestartPolicy
from tools.supervisor import Supervisor


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def children():
    procs = {"draft": _sleeper(), "target": _sleeper(), "gateway": _sleeper()}
    spawned: list[tuple[str, float]] = []

    def respawn(name: str) -> None:
        started = time.monotonic()
        procs[name] = _sleeper()
        spawned.append((name, started))  # after the new process is in place: the test kills that one

    yield procs, respawn, spawned
    for proc in procs.values():
        proc.kill()
        proc.wait()


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _kill(procs: dict, name: str) -> float:
    proc = procs[name]
    proc.kill()
    proc.wait()
    return time.monotonic()


def test_a_dead_child_is_restarted_with_a_doubling_delay_then_forgiven(children):
    procs, respawn, spawned = children
    messages: list[str] = []
    policy = RestartPolicy(initial_delay_s=0.2, max_delay_s=0.8, stable_s=2.0)
    supervisor = Supervisor(procs, respawn, policy, report=messages.append, poll_s=0.02)
    supervisor.start()
    try:
        delays = []
        for crash in range(4):
            killed = _kill(procs, "draft")
            _wait(lambda: len(spawned) == crash + 1)
            delays.append(spawned[-1][1] - killed)
        # 0.2, 0.4, 0.8, 0.8 s (the cap), as the supervisor says it will wait, and as long as that by
        # the clock: not sooner (bar the moment between the kill and the test reading the clock),
        # and later only by the polls a loaded machine delays.
        for got, want in zip(delays, [0.2, 0.4, 0.8, 0.8]):
            assert want - 0.05 <= got < want + 1.0, delays
        time.sleep(3.0)  # stays up past stable_s (2 s), with a second for the poll that forgives it
        killed = _kill(procs, "draft")
        _wait(lambda: len(spawned) == 5)
        assert 0.15 <= spawned[-1][1] - killed < 0.75  # forgiven: the first delay again, not the cap
        waits = [m.split("restarting it in ")[1] for m in messages if "restarting it in" in m]
        assert waits == ["0.2s", "0.4s", "0.8s", "0.8s", "0.2s"], messages
        assert {name for name, _ in spawned} == {"draft"} and supervisor.restarts["draft"] == 5
        assert procs["target"].poll() is None and supervisor.final_exit is None
        assert sum("restarted draft" in m for m in messages) == 5
        assert sum("draft exited with code -9" in m for m in messages) == 5
    finally:
        supervisor.stop()


def test_the_gateways_exit_ends_supervision_with_its_code_and_nothing_restarts_after_stop(children):
    procs, respawn, spawned = children
    supervisor = Supervisor(procs, respawn, RestartPolicy(initial_delay_s=0.05), report=lambda m: None, poll_s=0.02)
    supervisor.start()
    procs["gateway"].terminate()
    _wait(lambda: supervisor.final_exit is not None)
    assert supervisor.final_exit == -15 and not supervisor.running
    _kill(procs, "target")
    time.sleep(0.3)
    assert spawned == []  # supervision ended with the gateway
    other = Supervisor(procs, respawn, RestartPolicy(initial_delay_s=0.05), report=lambda m: None, poll_s=0.02)
    procs["gateway"] = _sleeper()
    other.start()
    other.stop()
    _kill(procs, "draft")
    time.sleep(0.3)
    assert spawned == [] and not other.running

