"""Measures what a verify forward costs at the sizes the engine will use, before the first request.

The γ controller prices every choice with the engine's own verify cost (target_service/gamma.py,
``CostModel``). Learnt online only, a new server knows nothing: its first steps either explore
deep (a γ of 10 at batch 8 once cost several plain steps on SmolLM2: docs/benchmarks.md, "Figures
behind design choices") or guess, and at batch sizes where speculation rarely pays it takes many
steps to find out. Kernels also work in blocks (the CPU
int4 kernel takes rows 4 at a time), a staircase an online fit learns one size at a time. So the
engine times one forward per shape here, at start-up, and the controller starts from those.

Shapes are what a decode step runs: ``rows`` sequences × ``width`` = 1 + the deepest γ positions,
all rows padded to the same width. Batch 1 takes every width up to ``max_width``; larger batches
(powers of two up to the slot count) a few widths. A sampling row that proposed settles by
Leviathan's rule where a greedy row takes an argmax (target_service/settle.py); what that adds is
timed once too (``sampled_verify_extra``). Sizes are measured smallest first, and
measuring stops at ``max_positions`` or once ``budget_s`` has passed, so a big model or a big slot
count costs a bounded start-up.

What it does not know: γ, drafts or requests; it runs forwards on free slots and reads the clock.
"""

from __future__ import annotations

import time

import torch

import kernels
from kernels.lm_head import Hidden
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.models.base import CausalLM
from specstream.models.kv_cache import KVCache
from target_service.settle import VerifyRow, settle

__all__ = ["sampled_verify_extra", "shapes", "verify_costs"]


def shapes(max_slots: int, max_width: int, max_positions: int = 512) -> list[tuple[int, int]]:
    """(rows, width) per forward to time, smallest first."""
    rows = {1 << k for k in range(max_slots.bit_length())} | {max_slots}  # powers of two, and the slot count
    wide = [w for w in (1, 2, 3, 5, 9) if w <= max_width]
    out = {(1, w) for w in range(1, max_width + 1)}
    out |= {(r, w) for r in rows if r > 1 for w in wide}
    return sorted((s for s in out if s[0] * s[1] <= max_positions), key=lambda s: (s[0] * s[1], s[0]))


def verify_costs(model: CausalLM, cache: KVCache, max_width: int, max_rows: int = 0, budget_s: float = 3.0,
                 max_positions: int = 512) -> list[tuple[int, float]]:
    """(positions, seconds) per shape measured: one forward plus the argmax a greedy verification
    takes, for up to ``max_rows`` rows (0: as many as there are free slots). Uses free slots of
    ``cache`` and leaves them free; call on the model's torch thread."""
    free = min(cache.num_free, max_rows or cache.num_free)
    slots = [cache.alloc() for _ in range(free)]
    try:
        out = []
        started = time.perf_counter()
        with torch.inference_mode():
            _forward(model, cache, slots, 1, 1)  # the first forward allocates; not timed
            for rows, width in shapes(free, max_width, max_positions):
                if time.perf_counter() - started > budget_s:
                    break
                t0 = time.perf_counter()
                _forward(model, cache, slots, rows, width)
                out.append((rows * width, time.perf_counter() - t0))
        return out
    finally:
        for slot in slots:
            cache.free(slot)


def _forward(model: CausalLM, cache: KVCache, slots: list[int], rows: int, width: int) -> None:
    input_ids = torch.zeros((rows, width), dtype=torch.int64)  # [rows, width]
    hidden = model.hidden(input_ids, cache, torch.tensor(slots[:rows], dtype=torch.int64),
                          torch.zeros(rows, dtype=torch.int64))  # [rows, width, H]
    # The output layer and a greedy 1-best, through the backend the engine uses; to the host, as a
    # verification does (which waits for a GPU).
    kernels.best_token(Hidden(hidden.flatten(0, 1), model.output_head))[0].cpu()  # [rows * width]


def sampled_verify_extra(model: CausalLM, cache: KVCache, q_width: int = 256, repeats: int = 5,
                         max_repeats: int = 40) -> float:
    """Seconds a sampling row's verification at γ = 1 (one guess with a ``q_width``-token q) takes
    beyond a greedy row's, over the same forward's states: the least of ``repeats`` timings each.
    A sampling row does strictly more work, so while the two least timings do not show it (a busy
    machine preempted every greedy timing so far) it keeps timing, up to ``max_repeats`` rounds.
    Needs a free slot of ``cache`` and leaves it free; call on the model's torch thread."""
    slot = cache.alloc()
    try:
        with torch.inference_mode():
            hidden = model.hidden(torch.zeros((1, 2), dtype=torch.int64), cache, torch.tensor([slot]),
                                  torch.zeros(1, dtype=torch.int64))  # [1, 2, H]
            states = Hidden(hidden.flatten(0, 1), model.output_head)
            width = min(q_width, model.config.vocab_size)
            q = {"q_width": width, "q_ids": list(range(width)), "q_probs": [1.0 / width] * width}
            rows = {kind: [VerifyRow(params, position=1, proposals=[0], drafted=1, **q)]
                    for kind, params in (("greedy", GREEDY), ("sampled", SamplingParams(temperature=1.0, seed=0)))}
            best = dict.fromkeys(rows, float("inf"))
            for round_ in range(max(repeats, max_repeats) + 1):  # the kinds interleaved; round 0 warms up
                if round_ > repeats and best["sampled"] > best["greedy"]:
                    break
                for kind, row in rows.items():
                    t0 = time.perf_counter()
                    settle(states, row)
                    if round_:
                        best[kind] = min(best[kind], time.perf_counter() - t0)
        return max(best["sampled"] - best["greedy"], 0.0)
    finally:
        cache.free(slot)
