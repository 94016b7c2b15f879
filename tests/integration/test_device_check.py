"""The stack step of `make gpu-check` (tools/bench/device_check.py) rehearsed on a CPU with a
tiny random target: the code a GPU machine's ten minutes depend on runs here first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import device_check

pytestmark = pytest.mark.integration


def test_device_check_runs_the_stack_and_checks_exactness(tmp_path: Path) -> None:
    result = device_check.run(tmp_path, "cpu", n_prompts=2, max_new_tokens=12, gammas=(2,), batch=4, requests=8)
    written = json.loads((tmp_path / "device_check.json").read_text())
    assert written["shape"] == device_check.TINY_SHAPE and written["dtype"] == "float32"
    assert set(written["latency"]) == {"plain", "2", "auto"}
    # Speculative greedy = plain greedy, prompt by prompt, in every run (float32 on a CPU).
    assert written["exact"] is True
    assert written["latency"]["2"]["exactness"] == {"identical": 2, "prompts": 2, "first_difference": None}
    assert written["exactness"].startswith("speculative greedy = plain greedy: identical on every prompt (2)")
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


def test_exactness_counts_identical_prompts_and_names_the_first_difference() -> None:
    plain = [[5, 6, 7], [8, 9], [1, 2]]
    assert device_check.exactness(plain, [[5, 6, 7], [8, 9], [1, 2]]) == {
        "identical": 3, "prompts": 3, "first_difference": None}
    got = device_check.exactness(plain, [[5, 6, 7], [8, 4], [1, 3]])
    assert got["identical"] == 1 and got["prompts"] == 3
    assert got["first_difference"] == ("prompt 1: first difference at generated position 1: token 4, expected 9 "
                                       "(2 tokens, expected 2)")
    latency = {"plain": {}, "2": {"exactness": got}, "auto": {"exactness": device_check.exactness(plain, plain)}}
    assert not device_check.all_exact(latency)
    assert device_check.exactness_line(latency) == ("speculative greedy = plain greedy: NOT identical: 2: 1/3 "
                                                    "identical, " + got["first_difference"])
