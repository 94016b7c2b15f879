"""The cost ratio c, measured on this machine with the models the benchmark serves.

c = (one draft decode step) / (one target decode step), both batch 1, T = 1, at the context length
the benchmark runs at, timed in this process with the models' own forward (no serving overhead):
the theory's idealised cost. Also the target's verify cost for γ + 1 positions relative to one,
since on a CPU a wider verify is not free (the theory assumes it is). A feature draft has no forward
of its own to time that way: ``measure_feature_costs`` times it as it serves, a propose call with
one new token and its feature (``measure_costs`` gives a feature draft's guess that way too).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from specstream.models.base import CausalLM
from specstream.serving.compute import on_torch_thread
from tools.bench.models import BenchModels


def step_ms(model: CausalLM, context: int, tokens: int, repeats: int = 30) -> float:
    """Median ms of a forward over `tokens` new positions after `context` cached ones."""
    cache = model.new_cache(1, context + tokens + 1)
    slot, start = torch.tensor([0]), torch.tensor([context])
    ids = torch.zeros(1, tokens, dtype=torch.int64)  # [1, T]
    with torch.inference_mode():
        model(torch.zeros(1, context, dtype=torch.int64), cache, slot, torch.tensor([0]))
        times = []
        for _ in range(repeats + 3):
            begin = time.perf_counter()
            model(ids, cache, slot, start)
            times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times[3:])


def measure_costs(models: BenchModels, context: int, gammas: list[int], draft_threads: int = 1) -> dict:
    """Target step and verify ms and the draft's step ms (and c), timed on the process's torch thread."""
    return on_torch_thread(_measure_costs, models, context, gammas, draft_threads)


def _measure_costs(models: BenchModels, context: int, gammas: list[int], draft_threads: int) -> dict:
    target = models.load("target")
    result = {"context": context, "dtype": models.dtype, "weights": target.weights,
              "target_step_ms": step_ms(target, context, 1),
              "target_verify_ms": {g: step_ms(target, context, g + 1) for g in gammas}}
    if models.feature_draft:  # a guess as it serves (its call ÷ γ), with one thread as the draft service runs it
        guess = measure_feature_costs(models.target, models.draft, models.dtype, context, max(gammas, default=4))
        result["draft_step_ms"] = guess["draft_ms_per_guess"]
        result["c"] = result["draft_step_ms"] / result["target_step_ms"]
    elif models.draft is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(draft_threads)  # as the draft service runs it
        result["draft_step_ms"] = step_ms(models.load("draft"), context, 1)
        torch.set_num_threads(threads)
        result["c"] = result["draft_step_ms"] / result["target_step_ms"]
    return result


def measure_feature_costs(target_dir: Path, draft_dir: Path, dtype: str = "bfloat16", context: int = 200,
                          gamma: int = 4, repeats: int = 30) -> dict:
    """A feature draft's cost as it serves: one propose call that appends one token with its
    feature and guesses 1 or ``gamma`` tokens (the head's forwards, its scoring and the Python
    around them), after ``context`` positions, one thread (as the draft service runs it); and the
    target's step with the benchmarks' own measurement. c = (the ``gamma`` call ÷ ``gamma``) ÷ step."""
    return on_torch_thread(_feature_costs, target_dir, draft_dir, dtype, context, gamma, repeats)


def _feature_costs(target_dir: Path, draft_dir: Path, dtype: str, context: int, gamma: int, repeats: int) -> dict:
    from draft_service.build import build_proposer
    from specstream.data.config import DraftConfig, ModelSpec
    from specstream.data.propose import ProposeItem
    from specstream.models.loader import load_model

    target = load_model(target_dir, dtype=dtype, weights="auto")
    target_ms = step_ms(target, context, 1)
    proposer = build_proposer(DraftConfig(ModelSpec(str(draft_dir), dtype), max_slots=2,
                                          max_seq_len=context + 4 * (repeats + 3) * (gamma + 1)))
    width = proposer.feature_width
    row = bytes(2 * width)  # zeros: the head's compute does not depend on the values
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        proposer.propose([ProposeItem(0, 0, [1] * context, 1, features=row * (context - 1), feature_width=width)])
        held, calls = context, {}
        for depth in (1, gamma):
            times = []
            for _ in range(repeats + 3):
                item = ProposeItem(0, held, [1], depth, features=row, feature_width=width)
                begin = time.perf_counter()
                held = proposer.propose([item])[0].length
                times.append((time.perf_counter() - begin) * 1000)
            calls[str(depth)] = statistics.median(times[3:])  # str keys: the same after a JSON round trip
    finally:
        torch.set_num_threads(threads)
    per_guess = calls[str(gamma)] / gamma
    return {"target_ms": target_ms, "draft_call_ms": calls, "draft_ms_per_guess": per_guess,
            "c": per_guess / target_ms, "c_one_guess": calls["1"] / target_ms, "context": context, "dtype": dtype,
            "threads": 1}
