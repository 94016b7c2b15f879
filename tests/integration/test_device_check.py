"""The stack step of `make gpu-check` (specstream/tools/bench/device_check.py) rehearsed on a CPU with a
tiny random target: the code a GPU machine's ten minutes depend on runs here first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstream.tools.bench import device_check

pytestmark = pytest.mark.integration


def test_device_check_runs_the_stack_and_checks_exactness(tmp_path: Path) -> None:
    result = device_check.run(tmp_path, "cpu", n_prompts=2, max_new_tokens=12, gammas=(2,), batch=4, requests=8)
    written = json.loads((tmp_path / "device_check.json").read_text())
    assert written["shape"] == device_check.TINY_SHAPE and written["dtype"] == "float32"
    assert set(written["latency"]) == {"plain", "2", "auto"}
    # α = 0.8 set: the synthetic draft's guesses are accepted, some of the time, by the real target.
    assert 0.3 < written["latency"]["2"]["alpha"] < 1.0
    assert written["latency"]["2"]["mean_accepted_length"] > 1.0
    assert list(written["throughput"]) == ["n=4 static all γ=4", "n=4 topup ε=1 all γ=4"]
    assert all(r["tokens_per_s"] > 0 and r["steps"] > 0 for r in written["throughput"].values())
    assert result["parameters"] == device_check.parameters(device_check.TINY_SHAPE, result["vocab"])
    assert (tmp_path / "device_check.png").exists()


def test_parameters_of_the_gpu_shape_are_about_a_billion() -> None:
    # TinyLlama's layers with a 32k vocabulary: 1.1B, as its model card says.
    assert 1.09e9 < device_check.parameters(device_check.GPU_SHAPE, 32_000) < 1.11e9
