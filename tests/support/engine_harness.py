"""Drives the target engine in one process (no gRPC): submit sequences, collect their tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from draft_service.feature import FeatureProposer
from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.engine import SequenceEvent, SequenceRequest, Speculation
from specstream.data.sampling import SamplingParams
from specstream.models.feature_draft import is_feature_draft, load_feature_draft
from specstream.models.loader import load_model
from specstream.text.grammar import compiler_for
from target_service.engine import Engine
from target_service.inprocess import run_requests
from target_service.local_draft import LocalDraft


def speculation(gamma: int | None) -> Speculation:
    """None: auto (the γ controller); 0: off; n: fixed n."""
    if gamma is None:
        return Speculation("auto")
    if gamma == 0:
        return Speculation("off")
    return Speculation("fixed", gamma)


def run_engine(target: Path, draft: Path | None, prompts: list[list[int]], gamma: int, max_new_tokens: int | list[int],
               stop_ids: list[int] = (), eos_ids: list[int] = (), max_slots: int = 8,
               sampling: list[SamplingParams] | None = None, logprobs: int | None = None,
               max_seq_len: int = 512, proposer=None, config: dict | None = None,
               steps: dict | None = None, device: str = "cpu",
               work_ahead: str = "off", min_tokens: int = 0,
               constraint: Constraint | list[Constraint | None] | None = None, grammar_draft: bool = True,
               penalties: Penalties | None = None) -> tuple[list[list[int]], list[SequenceEvent]]:
    """Returns each prompt's generated tokens and its final event (finish reason, stats, and the
    log-probabilities of all its tokens when `logprobs` is given). `sampling`: one per prompt
    (default greedy); `proposer` replaces the draft model's proposer (e.g. a wrapped one);
    `draft` may be a feature draft; `config` overrides TargetConfig fields (batching policy...); `steps`, when given, receives the
    engine's BatchStats and TargetMetrics and, per request id, the steps whose events carried its tokens; `device`: where
    both models run (float32); `work_ahead`: the in-process draft's (LocalDraft); `min_tokens`: every request's;
    `constraint`: every request's, or one per prompt (compiled on the target directory's tokenizer)."""
    model = load_model(target, device=device)
    # A draft model drafts constrained requests from its masked distribution unless `grammar_draft` is False.
    grammars = compiler_for(target) if constraint is not None and grammar_draft else None
    if proposer is None and draft and is_feature_draft(draft):
        proposer = FeatureProposer(load_feature_draft(draft, Path), max(16, max_slots), max_seq_len, grammars=grammars)
    elif proposer is None and draft:
        proposer = DraftProposer(load_model(draft, device=device), max_slots=max(16, max_slots), max_seq_len=max_seq_len,
                                 grammars=grammars)
    local = LocalDraft(proposer, work_ahead=work_ahead) if proposer else None
    engine = Engine(model, TargetConfig(model=ModelSpec(str(target), device=device), max_slots=max_slots,
                                        max_seq_len=max_seq_len,
                                        **{"max_gamma": 8, **(config or {})}), local,
                    grammars=compiler_for(target) if constraint is not None else None)
    sampling = sampling or [SamplingParams()] * len(prompts)
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)

    constraints = constraint if isinstance(constraint, list) else [constraint] * len(prompts)
    requests = [SequenceRequest(str(i), list(p), budget, frozenset(stop_ids), frozenset(eos_ids), speculation(gamma),
                                params, logprobs, min_tokens=min_tokens, constraint=c, penalties=penalties)
                for i, (p, params, budget, c) in enumerate(zip(prompts, sampling, budgets, constraints))]
    results = run_requests(engine, requests, timeout_s=60)
    finals = []
    for r in results:
        # all of the sequence's log-probabilities, not the last step's
        finals.append(dataclasses.replace(r.final, logprobs=r.logprobs))
        if steps is not None:
            steps[r.request_id] = r.steps
    if steps is not None:
        steps["stats"], steps["metrics"] = engine.stats, engine.metrics
    return [r.token_ids for r in results], finals


@torch.inference_mode()
def naive_greedy(target: Path, prompt: list[int], max_new_tokens: int, device: str = "cpu") -> list[int]:
    """Plain greedy decoding by full recomputation, independent of the engine and its cache logic."""
    model = load_model(target, device=device)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(torch.tensor([tokens], device=device), cache, torch.tensor([0], device=device),
                       torch.tensor([0], device=device))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]
