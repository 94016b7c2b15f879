"""The cost ratio c, measured on this machine with the models the benchmark serves.

c = (one draft decode step) / (one target decode step), both batch 1, T = 1, at the context length
the benchmark runs at, timed in this process with the models' own forward (no serving overhead):
the theory's idealised cost. Also the target's verify cost for γ + 1 positions relative to one,
since on a CPU a wider verify is not free (the theory assumes it is).
"""

from __future__ import annotations

import statistics
import time

import torch

from specstream.models.base import CausalLM
from specstream.serving.compute import on_torch_thread
from specstream.tools.bench.models import BenchModels


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
    if models.draft is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(draft_threads)  # as the draft service runs it
        result["draft_step_ms"] = step_ms(models.load("draft"), context, 1)
        torch.set_num_threads(threads)
        result["c"] = result["draft_step_ms"] / result["target_step_ms"]
    return result
