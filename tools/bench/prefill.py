"""Prompt processing (prefill), ours against llama.cpp's, on the same GGUF file and cores.

A request's time to its first token is mostly its prompt's prefill. Measured here on a 512-token
prompt and on the chat prompts the other benchmarks send: ours as the target serves it (the model
as loaded for serving, in chunks of ``prefill_chunk`` positions into a cache slot, each chunk
attending over the ones before it), and llama.cpp's ``eval`` of the same token ids in a process of
its own (its default batch of 512). Each prompt is timed ``repeats`` times, interleaved across
prompts, and its fastest run kept.
"""

from __future__ import annotations

import os
import time

import torch

from target_service.engine import prefill_chunk

LONG_PROMPT = 512  # tokens of the long prompt
PASSAGE = ("The committee met on a grey Tuesday morning to review the quarterly figures. Revenue had risen in "
           "three of the four regions, while costs in the northern office grew faster than planned. ")


def long_prompt(tokenizer, length: int = LONG_PROMPT) -> list[int]:
    """``length`` token ids of running English prose."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(PASSAGE)
    return ids[:length]


@torch.inference_mode()
def ours_prefill_ms(model, prompts: list[list[int]], repeats: int = 3) -> list[float]:
    """Per prompt, the fastest of ``repeats`` prefills as served (ms); on the torch thread."""
    chunk = prefill_chunk(0, model.device)  # the default
    cache = model.new_cache(1, max(len(p) for p in prompts) + 1)
    slot = cache.alloc()
    best = [float("inf")] * len(prompts)
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            began = time.perf_counter()
            for start in range(0, len(prompt), chunk):
                ids = torch.tensor([prompt[start:start + chunk]], dtype=torch.int64)
                model.hidden(ids, cache, torch.tensor([slot]), torch.tensor([start]), last_only=True)
            best[i] = min(best[i], (time.perf_counter() - began) * 1e3)
    return best


def llama_cpp_prefill_ms(gguf: str, prompts: list[list[int]], repeats: int = 3) -> list[float]:
    """llama.cpp's ``eval`` of each prompt from an empty context, the fastest of ``repeats`` (ms);
    run it in a process of its own (tools.bench.apart.run_apart)."""
    from llama_cpp import Llama  # optional: installed by `make peer`

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    best = [float("inf")] * len(prompts)
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            llm.reset()
            began = time.perf_counter()
            llm.eval(prompt)
            best[i] = min(best[i], (time.perf_counter() - began) * 1e3)
    return best
