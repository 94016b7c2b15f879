"""Measurements of a draft against its target: acceptance through the real engine, and cost per step.

``measure_acceptance`` runs held-out chat prompts through the target engine (in this process) with
the proposer the draft service would build (the draft model alone, or behind prompt lookup; its
weights as served) at a fixed γ and reports the per-token acceptance estimate α =
accepted / (accepted + rejections) (Leviathan et al.'s i.i.d. α) and the mean tokens per target
pass, also per domain; a prompt with a ``constraint`` (tools.distill.structured) is answered under
it, its grammar's forced tokens proposed as served. ``measure_costs`` times one forward of each
model on this machine with the benchmarks' own measurement: the draft proposing one token (one thread, as the draft service runs), the target
scoring one token and verifying γ+1 = 5 tokens, all at batch 1 after a 200-token context.
``record_acceptance`` writes the measured α into the draft's card (config.json
"specstream"."acceptance"), where the target's γ controller starts from it.

What it does not know: training, gRPC.
"""

from __future__ import annotations

import json
from pathlib import Path

from draft_service.build import build_proposer
from specstream.data.config import DraftConfig, ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest, Speculation
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from specstream.serving.compute import on_torch_thread
from specstream.text.grammar import GrammarCompiler
from specstream.text.tokenizer import TextTokenizer
from tools.distill.structured import constraint_of
from tools.progress import Progress
from target_service.engine import Engine
from target_service.inprocess import run_requests
from target_service.local_draft import LocalDraft

__all__ = ["measure_acceptance", "measure_costs", "record_acceptance"]


def measure_acceptance(target_dir: Path, draft_dir: Path, prompts: list[dict], *, temperature: float,
                       top_p: float = 1.0, gamma: int = 4, max_new_tokens: int = 96,
                       dtype: str = "bfloat16", proposer: str = "model", ngram_min: int = 1,
                       progress: Progress | None = None) -> dict:
    """α and tokens per pass with the draft as the service runs it (its weights "auto"), proposing
    with ``proposer`` (DraftConfig.PROPOSERS; "ngram+model" tries n-grams down to ``ngram_min``).
    ``progress`` counts each prompt's request as it finishes."""
    tok = TextTokenizer.from_dir(target_dir)
    # On the torch thread the engine runs on (specstream.serving.compute).
    target = on_torch_thread(load_model, target_dir, dtype=dtype, weights="auto")  # as served
    draft = on_torch_thread(build_proposer, DraftConfig(ModelSpec(str(draft_dir), dtype), max_slots=16,
                                                        max_seq_len=1024, proposer=proposer, ngram_min=ngram_min))
    config = TargetConfig(model=ModelSpec(str(target_dir), dtype), max_slots=16, max_seq_len=1024, max_gamma=8)
    grammars = GrammarCompiler(tok) if any(p.get("constraint") for p in prompts) else None
    engine = Engine(target, config, LocalDraft(draft), grammars=grammars)
    stop = [t for t in {tok.end_of_turn_id, *tok.eos_token_ids} if t is not None]
    requests = [SequenceRequest(str(p["id"]), tok.encode_chat(p["messages"]), max_new_tokens, frozenset(stop),
                                frozenset(stop), Speculation("fixed", gamma),
                                SamplingParams.from_settings(temperature, top_p=top_p, seed=p["id"]),
                                constraint=constraint_of(p))
                for p in prompts]
    results = run_requests(engine, requests,
                           on_finished=None if progress is None else lambda finished: progress.update())
    named = (draft.name if proposer == "model"
             else f"{proposer}, n-grams of {DraftConfig.ngram_max} down to {ngram_min} tokens")
    by_domain: dict[str, list] = {}
    for result, p in zip(results, prompts):
        if p.get("domain"):
            by_domain.setdefault(p["domain"], []).append(result)
    return {"proposer": named, **_counts(results), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "gamma": gamma, "temperature": temperature, "top_p": top_p,
            "by_domain": {d: {"prompts": len(rs), "mean_accepted_length": _counts(rs)["mean_accepted_length"]}
                          for d, rs in sorted(by_domain.items())}}


def _counts(results: list) -> dict:
    """α (accepted / (accepted + rejections)) and tokens per target pass over ``results``."""
    stats = [r.final.stats for r in results]
    accepted = sum(s.accepted_tokens for s in stats)
    rejections = sum(s.rejections for s in stats)
    tokens = sum(len(r.token_ids) for r in results)
    passes = sum(s.target_passes - 1 for s in stats)  # without the prefill pass
    return {"alpha": accepted / max(accepted + rejections, 1), "accepted": accepted,
            "proposed": sum(s.draft_tokens for s in stats), "rejections": rejections,
            "mean_accepted_length": (tokens - len(results)) / max(passes, 1)}


def measure_costs(target_dir: Path, draft_dir: Path, dtype: str = "bfloat16", context: int = 200) -> dict:
    """The benchmarks' cost measurement (``tools.bench.costs``): the draft on one thread, as
    the draft service runs it, both models after ``context`` cached tokens."""
    from tools.bench.costs import measure_costs as costs
    from tools.bench.models import BenchModels

    c = costs(BenchModels("card", target_dir, draft_dir, dtype), context, [4])
    return {"draft_ms": c["draft_step_ms"], "target_ms": c["target_step_ms"], "verify5_ms": c["target_verify_ms"][4],
            "ratio": c["c"], "dtype": dtype, "context": context}


def record_acceptance(draft_dir: Path, greedy: float | None, sampled: float | None = None) -> None:
    """Writes the draft's measured α (of the model alone: prompt lookup's rows are counted apart)
    for greedy and sampled requests into its config.json ("specstream"."acceptance"; None: not
    measured, left out), as ``specstream.models.config.card_acceptance`` reads it."""
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    measured = {kind: round(alpha, 3) for kind, alpha in (("greedy", greedy), ("sampled", sampled))
                if alpha is not None and 0.0 < alpha < 1.0}
    config.setdefault("specstream", {})["acceptance"] = measured
    path.write_text(json.dumps(config, indent=2) + "\n")
