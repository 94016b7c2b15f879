"""What sharing a beam's prefix costs, against copying it (transformers' `reorder_cache`).

Per beam step every hypothesis but one per parent moves to another KV row. We measure, for k
hypotheses at context length L on the benchmarked model:

- fork: k - 1 `KVCache.fork`s (tables of slot numbers are copied; no K/V);
- copy: k - 1 `KVCache.copy_prefix`es of the whole context in every layer (what a cache without
  sharing does, and what transformers does for all k rows every step);
- the decode forward of the k rows when they read through tables (keys and values gathered per
  position) and when each row's prefix is its own (contiguous slots): the price of the gather.

Runs on the process's torch thread (specstream.serving.compute).
"""

from __future__ import annotations

import time

import torch

from specstream.serving.compute import on_torch_thread


def measure(model, ks: tuple[int, ...] = (5, 10), contexts: tuple[int, ...] = (128, 512), repeats: int = 5) -> list[dict]:
    return on_torch_thread(_measure, model, ks, contexts, repeats)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


@torch.inference_mode()
def _measure(model, ks: tuple[int, ...], contexts: tuple[int, ...], repeats: int) -> list[dict]:
    longest = model.config.max_position_embeddings - 8
    contexts = tuple(dict.fromkeys(min(c, longest) for c in contexts))  # a short model: its longest context
    rows = []
    for k in ks:
        for context in contexts:
            cache = model.new_cache(2 * k, context + 8)
            shared = [cache.alloc() for _ in range(k)]
            own = [cache.alloc() for _ in range(k)]
            prompt = torch.randint(0, model.config.vocab_size, (1, context))  # [1, L]
            model.hidden(prompt, cache, torch.tensor([shared[0]]), torch.tensor([0]), last_only=True)
            cache.set_length(shared[0], context)
            for slot in own:
                cache.copy_prefix(shared[0], slot, context)

            def fork() -> None:
                for slot in shared[1:]:
                    cache.fork(shared[0], slot)

            def copy() -> None:
                for slot in own[1:]:
                    cache.copy_prefix(own[0], slot, context)

            fork_s, copy_s = _best(fork, repeats), _best(copy, repeats)
            step = torch.randint(0, model.config.vocab_size, (k, 1))  # [k, 1]
            at = torch.full((k,), context)

            def forward(slots: list[int]) -> None:
                model.hidden(step, cache, torch.tensor(slots), at)

            forward(shared), forward(own)  # warm-up
            gathered_s, contiguous_s = _best(lambda: forward(shared), repeats), _best(lambda: forward(own), repeats)
            per_position = 2 * cache.num_layers * cache.num_kv_heads * cache.head_dim * cache.k[0].element_size()
            rows.append({"k": k, "context": context, "fork_ms": 1e3 * fork_s, "copy_ms": 1e3 * copy_s,
                         "copy_bytes": (k - 1) * context * per_position, "fork_bytes": 0,
                         "forward_gathered_ms": 1e3 * gathered_s, "forward_contiguous_ms": 1e3 * contiguous_s})
    return rows
