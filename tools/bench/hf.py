"""Hugging Face transformers on the same checkpoints and prompts: `generate()` plain, with
`assistant_model=` (assisted generation with our draft's layers: our token draft's where ours reads
features, which transformers cannot feed it) and with prompt lookup, batch 1,
greedy or sampled. A benchmark/test dependency only.

Sampled runs use the full distribution at the given temperature (top_k=0: transformers' default
top_k=50 would otherwise truncate it, unlike our requests) and seed torch's global RNG with the
prompt's index before each prompt. Assisted sampling in transformers is Leviathan's exact
speculative sampling too, so its outputs follow the target's distribution but are not the same
token ids as ours."""

from __future__ import annotations

import time

import torch

from specstream.serving.compute import on_torch_thread
from tools.bench.models import BenchModels
from tools.progress import Progress

MODES = ("plain", "assisted", "assisted_heuristic", "prompt_lookup")
ASSISTED = ("assisted", "assisted_heuristic")  # with our draft's layers as the assistant model: need a draft


def runnable_modes(models: BenchModels, modes: tuple[str, ...] = MODES) -> tuple[str, ...]:
    """The ones of ``modes`` that hf_generate runs for ``models``, in order."""
    return tuple(m for m in modes if m in MODES and (m not in ASSISTED or models.assistant is not None))


def hf_generate(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, threads: int = 0,
                temperature: float = 0.0, dtype: str | None = None, modes: tuple[str, ...] = MODES,
                progress: Progress | None = None) -> dict:
    """Tokens/s of plain generate() and of assisted generation (our draft's layers as the assistant
    model, see BenchModels.hf_draft; and transformers' model-free prompt lookup), plus the token
    ids (greedy: to check they equal ours). temperature 0 is greedy; > 0 samples. ``dtype``:
    default the pair's serving dtype, so both sides do the same arithmetic. Runs on the process's
    torch thread, like every torch call of a benchmark (specstream.serving.compute: a second thread's
    OpenMP team would slow transformers down). ``progress`` counts each timed generation (the
    modes run: runnable_modes)."""
    return on_torch_thread(_hf_generate, models, prompts, max_new_tokens, threads, temperature, dtype, modes,
                           progress)


def _hf_generate(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, threads: int,
                 temperature: float, dtype: str | None, modes: tuple[str, ...], progress: Progress | None) -> dict:
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype or models.dtype)
    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch_dtype).eval()
    draft_dir = models.hf_draft()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch_dtype).eval() if draft_dir else None
    available = {"plain": ({}, None), "prompt_lookup": ({"prompt_lookup_num_tokens": 10}, None)}
    if draft is not None:
        # transformers' defaults (20 proposals, constant, stop early when the assistant's confidence
        # drops below 0.4), and the heuristic schedule of the assisted-generation blog post (start
        # at 5, +2 after a fully accepted step, -1 otherwise).
        available["assisted"] = ({"assistant_model": draft}, {})
        available["assisted_heuristic"] = ({"assistant_model": draft},
                                           {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                                            "assistant_confidence_threshold": 0.0})
    defaults = {k: getattr(draft.generation_config, k, None) for k in
                ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")} \
        if draft is not None else {}
    results = {}
    for name in runnable_modes(models, modes):
        extra, assistant_config = available[name]
        if draft is not None:
            for key, value in {**defaults, **(assistant_config or {})}.items():
                setattr(draft.generation_config, key, value)
        # eos_token_id=None generates past EOS, as our requests do with ignore_eos (min_new_tokens
        # would instead forbid EOS and change the output).
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=None, do_sample=False,
                      pad_token_id=target.config.eos_token_id, **extra)
        if temperature > 0:
            kwargs |= dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            torch.manual_seed(0)
            warm = torch.tensor([prompts[0]])
            target.generate(warm, attention_mask=torch.ones_like(warm), **{**kwargs, "max_new_tokens": 8})
            tokens, seconds, outputs = 0, 0.0, []
            for i, prompt in enumerate(prompts):
                torch.manual_seed(i)
                start = time.perf_counter()
                ids = torch.tensor([prompt])
                # An explicit mask: inferred from pad_token_id, it would hide every EOS in the prompt
                # (chat prompts end each turn with it) and change the output.
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                seconds += time.perf_counter() - start
                new = out[0, len(prompt):].tolist()
                tokens += len(new)
                outputs.append(new)
                if progress is not None:
                    progress.update()
        results[name] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "token_ids": outputs,
                         "dtype": str(torch_dtype).removeprefix("torch."),
                         "assistant": (f"{'our token' if models.feature_draft else 'our'} draft's layers, "
                                       "full-vocabulary head" if "assistant_model" in extra
                                       else "prompt lookup, 10 tokens" if name == "prompt_lookup" else None),
                         "assistant_config": {**defaults, **(assistant_config or {})} if assistant_config is not None
                         else None}
    return results
