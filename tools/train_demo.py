"""`specstream train-demo`: reproduce the shipped demo pair from the CPython standard library.

Corpus: the `.py` sources of the running interpreter's standard library (PSF license; every Python
installation has them offline). A fixed ~2.5% of files, chosen by a hash of their path, is held out.
Steps, each a stage of the command:
1. `tokenizer`: a byte-level BPE tokenizer (4096 tokens) trained on the training files.
2. `target`: a Llama (8 layers, 384 wide, ~14M parameters) trained on next-token loss.
3. `draft`: a Llama ~9x cheaper per token (2 layers, 192 wide), trained by distillation: its
   loss is the KL divergence to the target's next-token distribution on the same text, so it learns
   to agree with the target rather than with the data.
4. `card`: held-out loss of both, the draft's greedy acceptance rate α against the target (through
   the real engine), and a model card (README.md) in each directory.
Both models are saved in Hugging Face format (LlamaForCausalLM, float16 safetensors, tokenizer.json,
generation_config.json). Training uses `transformers` (a development dependency; serving never
imports it). Fixed step counts and seeds make a run repeatable on any machine; wall time is not.
"""

from __future__ import annotations

import json
import math
import os
import random
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specstream.text.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    TextTokenizer,
    build_byte_level_tokenizer,
    save_tokenizer_files,
)

DEMO_DIR = Path(__file__).parent.parent / "demo_models"
HELD_OUT_EVERY = 40  # a file is held out when crc32(path) % 40 == 0


@dataclass
class TrainConfig:
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    target_steps: int = 1100
    target_lr: float = 2e-3
    draft_steps: int = 1100
    draft_lr: float = 3e-3
    warmup_steps: int = 50
    seed: int = 0
    eval_tokens: int = 65536  # held-out tokens scored for the loss
    alpha_prompts: int = 24  # held-out prompts for the acceptance measurement
    threads: int = 0  # torch threads (0: one per core)


TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                    intermediate_size=1024)
DRAFT_SHAPE = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                   intermediate_size=512)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of the standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held_out = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        (held_out if zlib.crc32(rel.encode()) % HELD_OUT_EVERY == 0 else train).append(path)
    return train, held_out


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
    return texts


def encode(tok: TextTokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream: <s> document </s> <s> document </s> ..."""
    eos = tok.eos_token_ids[0]
    ids: list[int] = []
    for enc in tok.tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)  # [N]


def _batch(ids: torch.Tensor, cfg: TrainConfig, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(ids) - cfg.seq_len - 1) for _ in range(cfg.batch_size)]
    return torch.stack([ids[s : s + cfg.seq_len + 1] for s in starts]).long()  # [B, S+1]


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def _new_llama(shape: dict, cfg: TrainConfig, tok: TextTokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=tok.vocab_size, max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=10000.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_ids[0],
                         **shape)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def _train(model, steps: int, lr: float, cfg: TrainConfig, ids: torch.Tensor, loss_fn, log_name: str) -> float:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    model.train()
    start = time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, cfg.warmup_steps)
        batch = _batch(ids, cfg, rng)
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.monotonic() - start
            print(f"[{log_name}] step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"({elapsed / 60:.1f} min, {(step + 1) * batch.numel() / elapsed:.0f} tok/s)", flush=True)
    model.eval()
    return (time.monotonic() - start) / 60


def _next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _distill_loss(target):
    def loss(draft, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logp = F.log_softmax(target(input_ids=batch[:, :-1]).logits, dim=-1)  # [B, S, V]
        d_logp = F.log_softmax(draft(input_ids=batch[:, :-1]).logits, dim=-1)  # [B, S, V]
        # KL(target || draft): the draft learns the target's distribution, hence its argmax.
        return F.kl_div(d_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")

    return loss


@torch.no_grad()
def eval_loss(model, ids: torch.Tensor, cfg: TrainConfig) -> float:
    n = min(cfg.eval_tokens, len(ids) - 1) // cfg.seq_len * cfg.seq_len
    x = ids[: n + 1].long()
    losses = []
    for s in range(0, n, cfg.seq_len * cfg.batch_size):
        rows = [x[i : i + cfg.seq_len + 1] for i in range(s, min(s + cfg.seq_len * cfg.batch_size, n), cfg.seq_len)]
        rows = [r for r in rows if len(r) == cfg.seq_len + 1]
        batch = torch.stack(rows)
        losses.append(_next_token_loss(model, batch).item() * len(rows))
    return sum(losses) / (n // cfg.seq_len)


def _save(model, path: Path, tok: TextTokenizer, raw_tok) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    save_tokenizer_files(raw_tok, path, bos=BOS_TOKEN, eos=EOS_TOKEN)


def measure_alpha(target_dir: Path, draft_dir: Path, prompts: list[list[int]], gamma: int = 4,
                  max_new_tokens: int = 64) -> tuple[float, float]:
    """Greedy acceptance through the real engine (in one process): (α, fraction of proposals
    accepted), α being the i.i.d. estimate accepted / (accepted + passes with a rejection)."""
    from draft_service.proposer import DraftProposer
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest, Speculation
    from specstream.models.loader import load_model
    from specstream.serving.compute import on_torch_thread
    from target_service.engine import Engine
    from target_service.inprocess import run_requests
    from target_service.local_draft import LocalDraft

    # Loaded on the torch thread the engine runs on (specstream.serving.compute).
    engine = Engine(on_torch_thread(load_model, target_dir), TargetConfig(model=ModelSpec(str(target_dir)),
                                                                          max_slots=8, max_seq_len=1024),
                    LocalDraft(on_torch_thread(lambda: DraftProposer(load_model(draft_dir), 8, 1024))))
    spec = Speculation("fixed", gamma)
    final = [r.final for r in run_requests(engine, [
        SequenceRequest(str(i), list(p), max_new_tokens, speculation=spec) for i, p in enumerate(prompts)])]
    accepted = sum(e.stats.accepted_tokens for e in final)
    proposed = sum(e.stats.draft_tokens for e in final)
    rejections = sum(e.stats.rejections for e in final)
    return accepted / max(accepted + rejections, 1), accepted / max(proposed, 1)


def held_out_prompts(tok: TextTokenizer, texts: list[str], n: int, length: int = 48) -> list[list[int]]:
    """The first `length` tokens of `n` held-out files (long enough ones), as prompts."""
    prompts = []
    for text in texts:
        ids = tok.encode(text)
        if len(ids) > length + 64:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def write_card(path: Path, role: str, facts: dict) -> None:
    lines = [f"# specstream demo {role}", "",
             f"A small Llama trained from scratch on the CPython {facts['python']} standard library's `.py` sources "
             "(PSF license), for `make demo` and `specstream serve` without model flags. It writes Python-ish code; it "
             "is a demonstration model, not a useful assistant.", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts["rows"][role]]
    lines += ["", f"Reproduce (both models, one run): `{facts['command']}`", ""]
    (path / "README.md").write_text("\n".join(lines))


def main(out_dir: Path = DEMO_DIR, cfg: TrainConfig = TrainConfig(), stages: tuple[str, ...] = ("all",)) -> int:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stages = ("tokenizer", "target", "draft", "card") if "all" in stages else stages
    t_dir, d_dir = out_dir / "target", out_dir / "draft"
    train_files, held_files = stdlib_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    print(f"corpus: {len(train_texts)} train files, {len(held_texts)} held-out files", flush=True)
    times_path = out_dir / "train_log.json"
    log = json.loads(times_path.read_text()) if times_path.exists() else {}
    if "tokenizer" in stages:
        start = time.monotonic()
        raw = build_byte_level_tokenizer(train_texts, vocab_size=cfg.vocab_size)
        for path in (t_dir, d_dir):
            save_tokenizer_files(raw, path, bos=BOS_TOKEN, eos=EOS_TOKEN)
        log["tokenizer_minutes"] = (time.monotonic() - start) / 60
    tok = TextTokenizer.from_dir(t_dir)
    raw = tok.tokenizer
    train_ids = encode(tok, train_texts)
    held_ids = encode(tok, held_texts)
    log.update(train_tokens=len(train_ids), held_out_tokens=len(held_ids), config=asdict(cfg))
    print(f"tokens: {len(train_ids)} train, {len(held_ids)} held out", flush=True)
    if "target" in stages:
        target = _new_llama(TARGET_SHAPE, cfg, tok)
        log["target_minutes"] = _train(target, cfg.target_steps, cfg.target_lr, cfg, train_ids, _next_token_loss,
                                       "target")
        _save(target, t_dir, tok, raw)
    if "draft" in stages:
        from transformers import LlamaForCausalLM

        target = LlamaForCausalLM.from_pretrained(t_dir, dtype=torch.float32).eval()
        draft = _new_llama(DRAFT_SHAPE, cfg, tok)
        log["draft_minutes"] = _train(draft, cfg.draft_steps, cfg.draft_lr, cfg, train_ids, _distill_loss(target),
                                      "draft")
        _save(draft, d_dir, tok, raw)
    times_path.parent.mkdir(parents=True, exist_ok=True)
    times_path.write_text(json.dumps(log, indent=2))
    if "card" in stages:
        _card(t_dir, d_dir, tok, held_ids, held_texts, cfg, log)
    return 0


def _card(t_dir: Path, d_dir: Path, tok: TextTokenizer, held_ids: torch.Tensor, held_texts: list[str],
          cfg: TrainConfig, log: dict) -> None:
    import platform

    from transformers import LlamaForCausalLM

    losses, params = {}, {}
    for role, path in (("target", t_dir), ("draft", d_dir)):
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        losses[role] = eval_loss(model, held_ids, cfg)
        params[role] = sum(p.numel() for p in model.parameters())
    alpha, accepted_fraction = measure_alpha(t_dir, d_dir, held_out_prompts(tok, held_texts, cfg.alpha_prompts))
    log.update(held_out_loss=losses, parameters=params, greedy_alpha_gamma4=alpha,
               accepted_fraction_gamma4=accepted_fraction)
    (t_dir.parent / "train_log.json").write_text(json.dumps(log, indent=2))
    total = sum(log.get(k, 0.0) for k in ("tokenizer_minutes", "target_minutes", "draft_minutes"))
    common = [("data", f"CPython {platform.python_version()} stdlib `.py` files: {log['train_tokens']:,} training tokens; "
                       f"every file with crc32(path) % {HELD_OUT_EVERY} == 0 held out ({log['held_out_tokens']:,} tokens)"),
              ("tokenizer", f"byte-level BPE, {tok.vocab_size} tokens, trained on the training files"),
              ("training machine", f"{os.cpu_count()} CPU cores; whole pipeline {total:.0f} min")]
    rows = {
        "target": [("architecture", "LlamaForCausalLM, 8 layers, hidden 384, 6 heads (2 KV), MLP 1024, tied embeddings"),
                   ("parameters", f"{params['target'] / 1e6:.1f}M"),
                   ("training", f"{cfg.target_steps} steps x {cfg.batch_size}x{cfg.seq_len} tokens, next-token loss, "
                                f"AdamW lr {cfg.target_lr} cosine; {log.get('target_minutes', 0):.0f} min"),
                   ("held-out loss", f"{losses['target']:.3f} nats/token"),
                   ("greedy α of the demo draft against it (γ=4)", _alpha_cell(alpha, accepted_fraction, cfg)),
                   *common],
        "draft": [("architecture", "LlamaForCausalLM, 2 layers, hidden 192, 3 heads (1 KV), MLP 512, tied embeddings"),
                  ("parameters", f"{params['draft'] / 1e6:.1f}M"),
                  ("training", f"{cfg.draft_steps} steps x {cfg.batch_size}x{cfg.seq_len} tokens, distilled: "
                               f"KL(target || draft), AdamW lr {cfg.draft_lr} cosine; {log.get('draft_minutes', 0):.0f} min"),
                  ("held-out loss", f"{losses['draft']:.3f} nats/token"),
                  ("greedy α against the demo target (γ=4)", _alpha_cell(alpha, accepted_fraction, cfg)), *common],
    }
    facts = {"python": platform.python_version(), "rows": rows, "command": "specstream train-demo"}
    write_card(t_dir, "target", facts)
    write_card(d_dir, "draft", facts)
    print(json.dumps({k: log[k] for k in ("held_out_loss", "parameters", "greedy_alpha_gamma4",
                                          "accepted_fraction_gamma4")}, indent=2), flush=True)


def _alpha_cell(alpha: float, accepted_fraction: float, cfg: TrainConfig) -> str:
    return (f"{alpha:.3f} (per-token, accepted / (accepted + rejections); {accepted_fraction:.3f} of proposals "
            f"accepted) on {cfg.alpha_prompts} held-out prompts x 64 tokens")
