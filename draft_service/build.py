"""Building the proposer a ``DraftConfig`` names: the draft model (a token draft, or a feature draft
that reads the target's features), prompt-lookup n-grams or suffix drafting, either with the model,
or the synthetic benchmark proposer. The draft service builds its proposer here, and so does a target
that runs its draft in its own process (``TargetConfig.colocated_draft``). A draft model gets a
grammar compiler on its tokenizer (a feature draft's: its target's), so that it drafts constrained
sequences from their masked distribution.

What it does not know: gRPC, which process it is in. It loads on the calling thread: call it on
the thread that will run the proposer (``specstream.serving.compute``).
"""

from __future__ import annotations

from collections.abc import Callable

from draft_service.combined import NgramPlusModelProposer
from draft_service.feature import FeatureProposer
from draft_service.ngram import NgramProposer
from draft_service.proposer import DraftProposer
from draft_service.suffix import SuffixProposer
from draft_service.synthetic import SyntheticProposer
from specstream.data.config import DraftConfig
from specstream.data.propose import Proposer
from specstream.models.feature_draft import is_feature_draft, load_feature_draft
from specstream.models.loader import load_model
from specstream.models.registry import resolve_dtype, resolve_model
from specstream.text.grammar import compiler_for

__all__ = ["PROPOSERS", "build_proposer"]


def build_proposer(config: DraftConfig) -> Proposer:
    """The proposer ``config`` names, its draft model loaded (on the calling thread) if it has one."""
    if config.synthetic_oracle:
        return SyntheticProposer.from_file(config.synthetic_oracle, config.synthetic_alpha, config.synthetic_seed)
    proposer = PROPOSERS[config.proposer](config)
    # A draft model keeps its runner-ups (more than one outcome) only when it works ahead.
    proposer.prepare_outcomes(config.work_ahead_outcomes)
    return proposer


def _draft_model(config: DraftConfig) -> DraftProposer | FeatureProposer:
    """The draft model: a token draft (a causal LM checkpoint) or a feature draft (a head over the
    target's features, specstream/models/feature_draft.py), whichever ``config.model`` holds."""
    spec = config.model
    if is_feature_draft(resolve_model(spec.path)):
        if spec.device != "cpu":
            raise ValueError(f"model.device={spec.device!r}: a feature draft ({spec.path}) runs on the CPU only")
        draft = load_feature_draft(resolve_model(spec.path), resolve_model, resolve_dtype(spec.dtype, spec.device),
                                   spec.weights)
        grammars = compiler_for(draft.target_dir) if draft.target_dir and config.grammar_draft else None
        return FeatureProposer(draft, config.max_slots, config.max_seq_len, config.q_support, grammars,
                               config.prefix_cache_slots)
    model = load_model(resolve_model(spec.path), dtype=resolve_dtype(spec.dtype, spec.device), device=spec.device,
                       resolve=resolve_model, weights=spec.weights, draft=True)
    return DraftProposer(model, config.max_slots, config.max_seq_len, config.q_support,
                         compiler_for(resolve_model(spec.path)) if config.grammar_draft else None,
                         config.prefix_cache_slots)


# DraftConfig.proposer -> how to build it (the keys are DraftConfig.PROPOSERS).
PROPOSERS: dict[str, Callable[[DraftConfig], Proposer]] = {
    "model": _draft_model,
    "ngram": lambda config: NgramProposer(config.max_slots, config.max_seq_len, config.ngram_min, config.ngram_max),
    "ngram+model": lambda config: NgramPlusModelProposer(_draft_model(config), config.max_slots, config.ngram_min,
                                                         config.ngram_max),
    "suffix": lambda config: _suffix(config, config.max_seq_len),
    "suffix+model": lambda config: _suffix_and_model(config),
}


def _suffix(config: DraftConfig, max_len: int) -> SuffixProposer:
    return SuffixProposer(config.max_slots, max_len, config.ngram_min, config.ngram_max, config.suffix_capacity)


def _suffix_and_model(config: DraftConfig) -> NgramPlusModelProposer:
    model = _draft_model(config)
    return NgramPlusModelProposer(model, config.max_slots, lookup=_suffix(config, model.max_len))
