"""`make gpu-check` (tools/gpu_check.py) where there is no GPU: its dry run, and the driver's
survival of failing, hanging and late steps, with stand-in steps; the stack step's code path is
rehearsed on a CPU in tests/integration/test_device_check.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_the_dry_run_imports_every_step_and_lists_the_wheels(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("no CUDA: dry run")
    report = json.loads((tmp_path / "dry-run.json").read_text())
    assert report["import_failures"] == []
    assert report["steps"] == ["environment", "kernel-tests", "stack", "bench-kernels", "smollm2"]
    # The services' own dependencies travel; what the GPU image holds does not.
    assert {"grpcio", "protobuf", "gguf"} <= set(report["wheels"])
    # A gateway without an HTTP front never imports the web stack, so the check does not carry it.
    assert not {"fastapi", "uvicorn", "pydantic", "pydantic-core", "starlette"} & set(report["wheels"])
    probe = subprocess.run([sys.executable, "-c", "import sys, gateway.server; "
                            "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic', 'starlette') if m in sys.modules))"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    assert not {"torch", "triton", "numpy", "transformers"} & set(report["wheels"])
    # (The tree and the wheels fit in what travels: the dry run exits 1 otherwise.)


def test_the_dry_run_fails_on_a_step_that_does_not_import(gpu_check, tmp_path: Path, monkeypatch) -> None:
    broken = gpu_check.Step("environment", "x", 10, 1, ("specstream.no_such_module",))
    monkeypatch.setattr(gpu_check, "STEPS", (broken,))
    assert gpu_check.dry_run(tmp_path) == 1
    failures = json.loads((tmp_path / "dry-run.json").read_text())["import_failures"]
    assert len(failures) == 1 and "specstream.no_such_module" in failures[0]


def _stand_ins(gpu_check, scripts: dict[str, str], limits: dict[str, float] | None = None):
    limits = limits or {}
    steps = tuple(gpu_check.Step(name, f"stand-in {name}", limits.get(name, 30), 1, ()) for name in scripts)
    return steps, lambda step, work: [sys.executable, "-c", scripts[step.name], str(work)]


def test_a_failing_or_hanging_step_is_recorded_and_the_rest_still_run(gpu_check, tmp_path: Path) -> None:
    write = "import json, sys, pathlib; pathlib.Path(sys.argv[1], '{0}.json').write_text(json.dumps({{'value': {1}}}))"
    steps, command = _stand_ins(gpu_check, {
        "first": write.format("first", 1),
        "crash": "raise SystemExit('the GPU fell over')",
        "hang": "import time; time.sleep(60)",
        "last": write.format("last", 2),
    }, limits={"hang": 2})
    work = tmp_path / "work"
    work.mkdir()
    outcomes = gpu_check.run_steps(steps, work, budget_s=120, env=None, command=command)
    assert [(o.step, o.status) for o in outcomes] == [("first", "ok"), ("crash", "failed"), ("hang", "timed out"),
                                                      ("last", "ok")]
    assert "the GPU fell over" in outcomes[1].detail
    assert outcomes[3].data == {"value": 2}
    files = gpu_check.pack(work, tmp_path / "out", outcomes, steps)
    assert len(files) <= 8 and all(f.exists() for f in files)
    summary = (tmp_path / "out" / "summary.md").read_text()
    measured, not_measured = summary.split("\n\n")[1:3]
    assert measured.startswith("Measured: first") and "last" in measured and "crash" not in measured
    assert "crash: failed" in not_measured and "hang: timed out" in not_measured
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert {"first.log", "crash.log", "hang.log", "last.log"} <= set(tar.getnames())
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        assert set(tar.getnames()) == {"first.json", "last.json"}


def test_later_steps_keep_their_reserve_of_the_budget(gpu_check, tmp_path: Path) -> None:
    sleeps = {"slow": 60, "late": 0}
    command = lambda step, work: [sys.executable, "-c", f"import time; time.sleep({sleeps[step.name]})"]  # noqa: E731
    steps = (gpu_check.Step("slow", "x", 30, 1, ()), gpu_check.Step("late", "y", 30, 10, ()))
    outcomes = gpu_check.run_steps(steps, tmp_path, budget_s=13, env=None, command=command)
    # "slow" may use 13 - 10 s, the reserve of "late", which then still runs.
    assert outcomes[0].status == "timed out" and outcomes[0].seconds < 6
    assert outcomes[1].status == "ok"
    # A step whose later steps' reserves leave it less than half its own least time is not started.
    steps = (gpu_check.Step("slow", "x", 30, 4, ()), gpu_check.Step("late", "y", 30, 20, ()))
    outcomes = gpu_check.run_steps(steps, tmp_path, budget_s=12, env=None, command=command)
    assert outcomes[0].status == "skipped" and "budget" in outcomes[0].detail
    assert outcomes[1].status == "ok"


def test_a_step_that_times_out_keeps_the_figures_it_wrote_as_it_went(gpu_check, tmp_path: Path) -> None:
    # Like bench kernels: each size's figures into kernels.json as measured, then slow sizes past the limit.
    script = ("import json, sys, time, pathlib; pathlib.Path(sys.argv[1], 'kernels.json').write_text(json.dumps("
              "{'sizes': [{'vocab': 32000, 'rows': 1, 'hidden': 2048, 'ms': {'unfused': 0.1, 'fused': 33.0}}]})); "
              "time.sleep(60)")
    step = gpu_check.Step("bench-kernels", "stand-in", 2, 1, (), "kernels.json")
    outcomes = gpu_check.run_steps((step,), tmp_path, budget_s=30, env=None,
                                   command=lambda step, work: [sys.executable, "-c", script, str(work)])
    assert outcomes[0].status == "timed out"
    assert outcomes[0].data["sizes"][0]["ms"] == {"unfused": 0.1, "fused": 33.0}
    summary = gpu_check.summary(outcomes, (step,))
    assert "| 32000 | 1 | 2048 | 0.100 | 33.000 |" in summary and "(partial: kernels.json, as far as it got)" in summary
