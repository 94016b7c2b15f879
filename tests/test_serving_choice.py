"""The target's start-up log names the dtype and weights it serves with, what was asked, and the CPU
features that decided them (specstream/models/loader.py ``serving_choice``)."""

from __future__ import annotations

import torch

from kernels.int4 import q4_native
from specstream.models.loader import load_model, serving_choice
from specstream.models.registry import bfloat16_features, resolve_dtype
from specstream.serving.compute import cpu_name


def test_the_choice_names_what_was_asked_what_serves_and_the_features_that_decided(model_zoo) -> None:
    model = load_model(model_zoo["target"], dtype="float32", weights="dense")
    line = serving_choice(model, "float32", "dense")
    assert line.startswith("dtype float32 -> float32; weights dense -> dense; on ")
    assert cpu_name() in line
    for name, flag in bfloat16_features().items():  # what resolve_dtype("auto") decides by
        assert f"{name} {'yes' if flag else 'no'}" in line
    assert f"float32 {'yes' if q4_native(torch.float32) else 'no'}" in line
    # "auto" is bfloat16 exactly where one of those features is there
    assert (resolve_dtype("auto") == "bfloat16") == any(bfloat16_features().values())


def test_a_served_stack_logs_it_at_start_up(model_zoo, tmp_path) -> None:
    from tools.launcher import Stack, StackSpec

    spec = StackSpec(str(model_zoo["target"]), None, max_seq_len=128, log_dir=str(tmp_path))
    with Stack(spec):
        pass
    log = (tmp_path / "target.log").read_text()
    assert "target model: dtype " in log and cpu_name() in log, log[-2000:]
