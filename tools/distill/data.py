"""Distillation data: the target's own responses to the prompt set, with its next-token distribution.

Contract: ``generate_responses(target_dir, prompts, ...)`` runs the real target engine (in this
process, batched, top-up) on every prompt rendered with the model's chat template, and returns one
record per prompt: prompt ids, response ids, and for every response token the target's ``TOP_K``
most likely next tokens with their log-probabilities under the distribution the token came from.
Half the prompts are answered greedily and half by plain sampling at temperature 1 (no top-k/top-p),
so in both cases those log-probabilities are the target's unprocessed softmax: exactly the teacher
distribution for KL distillation, captured during generation at no extra forward pass. A prompt
with a ``constraint`` (``{"kind", "source"}``: tools.distill.structured) is answered under it, as
the service answers a structured-output request (its logprobs are then the masked distribution's;
the feature draft's training recomputes its teacher from the target's features).
``save_records``/``load_records`` store them as one safetensors file (no pickle).

What it does not know: the draft, training.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest, Speculation
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.models.loader import load_model
from specstream.serving.compute import on_torch_thread
from specstream.text.grammar import GrammarCompiler
from specstream.text.tokenizer import TextTokenizer
from tools.distill.structured import constraint_of
from tools.progress import Progress
from target_service.engine import Engine
from target_service.inprocess import run_requests

__all__ = ["TOP_K", "Record", "generate_responses", "load_records", "save_records"]

TOP_K = 32  # teacher alternatives kept per position


@dataclass
class Record:
    prompt_id: int
    split: str  # "train" or "held_out"
    sampled: bool  # temperature-1 sampling (else greedy)
    prompt: list[int]
    response: list[int]
    top_ids: torch.Tensor  # [len(response), TOP_K] int32: the target's most likely tokens at each step
    top_logprobs: torch.Tensor  # [len(response), TOP_K] float32


def generate_responses(target_dir: Path, prompts: list[dict], *, dtype: str, max_new_tokens: int,
                       max_slots: int = 48, log_every: int = 200, quiet: bool = False,
                       weights: str = "dense") -> list[Record]:
    """One record per prompt that fits the context (see the module docstring). Progress on stderr
    (tools.progress; ``quiet``: plain lines, never a bar), counted in prompts answered.
    ``weights``: the target's (load_model's), "auto" as it serves."""
    tok = TextTokenizer.from_dir(target_dir)
    model = on_torch_thread(load_model, target_dir, dtype=dtype, weights=weights)  # where the engine runs (specstream.serving.compute)
    config = TargetConfig(model=ModelSpec(str(target_dir), dtype), max_slots=max_slots, max_seq_len=1024,
                          default_gamma=0, max_gamma=8)
    grammars = GrammarCompiler(tok) if any(p.get("constraint") for p in prompts) else None
    engine = Engine(model, config, None, grammars=grammars)
    stop = [t for t in {tok.end_of_turn_id, *tok.eos_token_ids} if t is not None]
    requests, meta = [], []
    for p in prompts:
        ids = tok.encode_chat(p["messages"])
        if len(ids) + max_new_tokens > engine.max_context_length:
            continue
        sampled = zlib.crc32(f"mode:{p['id']}".encode()) % 2 == 1
        sampling = SamplingParams(temperature=1.0, top_p=1.0, seed=p["id"]) if sampled else GREEDY
        requests.append(SequenceRequest(str(p["id"]), ids, max_new_tokens, frozenset(stop), frozenset(stop),
                                        Speculation("off"), sampling, logprobs=TOP_K, constraint=constraint_of(p)))
        meta.append((p, ids, sampled))
    done_count = [0, 0]
    with Progress(len(requests), "prompts", "train-draft: generate", quiet=quiet) as progress:
        def finished(result) -> None:
            done_count[0] += 1
            done_count[1] += len(result.token_ids)
            progress.update()
            if done_count[0] % log_every == 0 or done_count[0] == len(requests):
                progress.print(f"[generate] {done_count[0]}/{len(requests)} prompts, {done_count[1]} response tokens")

        answered = run_requests(engine, requests, timeout_s=600, on_finished=finished)
    records = []
    for (p, ids, sampled), done in zip(meta, answered):
        if done.final is None or done.finish_reason == "error":
            raise RuntimeError(f"prompt {p['id']}: generation failed: {done.final}")
        # A constrained position may allow fewer than TOP_K tokens: the rest repeat its first with
        # probability 0.
        tops = [lp.top + [(lp.top[0][0], -math.inf)] * (TOP_K - len(lp.top)) for lp in done.logprobs]
        top_ids = torch.tensor([[t for t, _ in top] for top in tops], dtype=torch.int32)
        top_lp = torch.tensor([[v for _, v in top] for top in tops], dtype=torch.float32)
        records.append(Record(p["id"], p["split"], sampled, ids, list(done.token_ids), top_ids.reshape(-1, TOP_K),
                              top_lp.reshape(-1, TOP_K)))
    return records


def save_records(records: list[Record], path: Path) -> None:
    """One safetensors file: concatenated tensors plus an index in the metadata."""
    index = [{"prompt_id": r.prompt_id, "split": r.split, "sampled": r.sampled, "prompt_len": len(r.prompt),
              "response_len": len(r.response)} for r in records]
    tensors = {
        "prompt_ids": torch.tensor([t for r in records for t in r.prompt], dtype=torch.int32),
        "response_ids": torch.tensor([t for r in records for t in r.response], dtype=torch.int32),
        "top_ids": torch.cat([r.top_ids for r in records]),
        "top_logprobs": torch.cat([r.top_logprobs for r in records]).to(torch.float16),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"index": json.dumps(index)})


def load_records(path: Path) -> list[Record]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        index = json.loads(fh.metadata()["index"])
    tensors = load_file(str(path))
    records, p_at, r_at = [], 0, 0
    for item in index:
        n, m = item["prompt_len"], item["response_len"]
        records.append(Record(item["prompt_id"], item["split"], item["sampled"],
                              tensors["prompt_ids"][p_at : p_at + n].tolist(),
                              tensors["response_ids"][r_at : r_at + m].tolist(),
                              tensors["top_ids"][r_at : r_at + m], tensors["top_logprobs"][r_at : r_at + m].float()))
        p_at, r_at = p_at + n, r_at + m
    return records
