"""`specstream soak`'s measurement on the three real processes (tiny models, seconds instead of
minutes), and its slope arithmetic."""

from __future__ import annotations

import asyncio

import pytest

from tools.reliability.soak import slope_per_minute, soak


def test_slope_is_least_squares_per_minute() -> None:
    assert slope_per_minute([(0.0, 100.0), (30.0, 100.5), (60.0, 101.0)]) == pytest.approx(1.0)
    assert slope_per_minute([(0.0, 5.0), (60.0, 3.0), (120.0, 4.0), (180.0, 2.0)]) == pytest.approx(-0.8)
    assert slope_per_minute([(1.0, 7.0)]) == 0.0


def test_a_short_soak_reports_memory_errors_and_latency(stack_factory, model_zoo, capsys) -> None:
    stack = stack_factory(model_zoo["target"], model_zoo["partial"])
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    report = asyncio.run(soak(stack.gateway_address, pids, seconds=8, concurrency=4, sample_s=0.5,
                              max_new_tokens=24))
    assert report.errors == {} and report.requests >= 8 and report.tokens >= report.requests
    assert {p.name for p in report.processes} == {"draft", "target", "gateway"}
    for proc in report.processes:
        assert len(proc.samples) >= 10 and proc.start_mb > 10, proc.name  # real processes' RSS, sampled
        assert proc.slope_mb_per_min == pytest.approx(
            slope_per_minute([s for s in proc.samples if s[0] >= report.warmup_s]), abs=1e-6)
    assert report.latency_first_ms_per_token > 0 and report.latency_last_ms_per_token > 0
    assert len(report.timeline) == report.requests
    # its progress, in seconds of the soak: off a terminal, plain lines on stderr (the first, the
    # last, and at most one per 10 s between), ending at its whole duration
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("soak: ")]
    assert progress[0].startswith("soak: 0/8 seconds (0%)") and progress[-1].startswith("soak: 8/8 seconds (100%)")
    assert len(progress) == 2
