"""`specstream train-draft`: reproduce the shipped SmolLM2 draft, stage by stage.

Stages (each resumable; intermediate files live in the work directory, the results in the draft
directory that ships with the package):

1. ``prompts``: the chat prompt set (``tools.distill.prompts``) written to
   ``<draft>/prompts.jsonl.gz``. A retrain reads that file, so it does not depend on which
   documentation this machine has installed; ``--rebuild-prompts`` makes it anew.
2. ``generate``: the target answers every prompt (``tools.distill.data``), recording its
   top-32 next-token distribution at each response token -> ``<work>/records.safetensors``.
3. ``train``: distillation of the draft (``tools.distill.train``) on the training split.
4. ``card``: greedy and sampled acceptance on the held-out prompts through the real engine, the
   draft's cost per step relative to the target's, and the model card ``<draft>/README.md``.

What it does not know: gRPC, serving.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tools.distill import train
from tools.distill.data import generate_responses, load_records, save_records
from tools.distill.prompts import build_prompts

__all__ = ["DistillConfig", "STAGES", "main"]

STAGES = ("prompts", "generate", "train", "card")


@dataclass
class DistillConfig:
    num_prompts: int = 2600  # documentation snippets asked about (train + held out), per round
    rounds: int = 2  # each round asks about every snippet with another instruction template
    max_new_tokens: int = 192  # per response
    dtype: str = "bfloat16"  # the target's serving dtype: the draft learns what the service will verify
    seed: int = 0
    threads: int = 0  # torch threads (0: one per core)
    rebuild_prompts: bool = False


def write_prompts(path: Path, prompts: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p, ensure_ascii=False) + "\n")


def read_prompts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(target_dir: Path, draft_dir: Path, work_dir: Path, cfg: DistillConfig, stages: tuple[str, ...],
         quiet: bool = False) -> int:
    """Runs ``stages`` (STAGES, or "all") in order. Progress on stderr (tools.progress;
    ``quiet``: plain lines, never a bar): per stage, its prompts answered, training steps or
    requests measured."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stages = STAGES if "all" in stages else stages
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log["config"] = asdict(cfg)
    prompts_path = draft_dir / "prompts.jsonl.gz"
    if "prompts" in stages and (cfg.rebuild_prompts or not prompts_path.exists()):
        prompts = build_prompts(cfg.num_prompts, cfg.seed, cfg.rounds)
        write_prompts(prompts_path, prompts)
        print(f"[prompts] {len(prompts)} prompts -> {prompts_path}", flush=True)
    prompts = read_prompts(prompts_path)
    records_path = work_dir / "records.safetensors"
    if "generate" in stages:
        _generate(target_dir, prompts, records_path, cfg, log, quiet)
    log_path.write_text(json.dumps(log, indent=2))
    if "train" in stages or "card" in stages:
        records = load_records(records_path)
        if "train" in stages:
            log.update(train.train_draft(target_dir, draft_dir, records, cfg.seed, quiet=quiet))
            log_path.write_text(json.dumps(log, indent=2))
        if "card" in stages:
            log.update(train.write_card(target_dir, draft_dir, records, prompts, log, quiet=quiet))
            log_path.write_text(json.dumps(log, indent=2))
    return 0


def _generate(target_dir: Path, prompts: list[dict], records_path: Path, cfg: DistillConfig, log: dict,
              quiet: bool) -> None:
    """The ``generate`` stage: the target answers the prompts not answered yet, into ``records_path``;
    its minutes and response tokens go into ``log``."""
    start = time.monotonic()
    # Resumable: prompts already answered (an earlier run, an earlier round) are kept.
    records = load_records(records_path) if records_path.exists() else []
    done = {r.prompt_id for r in records}
    todo = [p for p in prompts if p["id"] not in done]
    print(f"[generate] {len(done)} prompts answered already, {len(todo)} to go", flush=True)
    if todo:
        records += generate_responses(target_dir, todo, dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens,
                                      quiet=quiet)
        save_records(records, records_path)
    log["generate_minutes"] = log.get("generate_minutes", 0.0) + (time.monotonic() - start) / 60
    log["response_tokens"] = sum(len(r.response) for r in records)
    print(f"[generate] {len(records)} records, {log['response_tokens']} tokens in "
          f"{log['generate_minutes']:.1f} min -> {records_path}", flush=True)
