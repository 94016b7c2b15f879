"""The noisy-host benchmark's neighbours: busy loops at nice 19, in our session or in one of their own."""

from __future__ import annotations

import os
import subprocess

import pytest

from tools.bench import noisy


@pytest.mark.parametrize("session", noisy.SESSIONS)
def test_busy_loops_run_at_nice_19_in_the_session_asked_for(session, monkeypatch):
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(noisy.subprocess, "Popen", popen)
    with noisy.noisy_neighbours(2, session=session):
        assert len(started) == 2
        for proc in started:
            assert proc.poll() is None  # busy while the block runs
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
            assert (os.getsid(proc.pid) == os.getsid(0)) == (session == "ours")
    assert all(proc.poll() is not None for proc in started)  # gone after it


def test_an_unknown_session_is_refused():
    with pytest.raises(ValueError, match="session='elsewhere'"):
        with noisy.noisy_neighbours(1, session="elsewhere"):
            pass
