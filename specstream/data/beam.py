"""A request's beam-search options, validated in one place (the gateway and the target engine
both build them here; field names are as the public request spells them, ``beam.num_beams``).

Beam search is greedy only: ``check_combination`` refuses sampling, fixed speculation, logprobs,
stop strings and min_tokens beside it, naming the field (specstream/data/request_rules.py calls
it, with the one limit only a target knows: num_beams against its slots and rows per step). ``from_pb`` reads the ``specstream.v1.BeamSearch``
message at the edges. Knows nothing about models or engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from specstream.data.errors import InvalidArgumentError

__all__ = ["BeamOptions", "EarlyStopping", "EARLY_STOPPING", "check_combination"]

# When a beam search ends, as transformers' `early_stopping` defines it: "heuristic" (False, its
# default: once the best running hypothesis, scored at the current length, cannot beat the worst of
# the k finished ones), "first_k" (True: as soon as k hypotheses have finished), "never" (the
# canonical rule: only when no running hypothesis can improve, at the best length it could reach).
EarlyStopping = Literal["heuristic", "first_k", "never"]
EARLY_STOPPING: tuple[EarlyStopping, ...] = ("heuristic", "first_k", "never")
_EARLY_STOPPING_PB = {0: "heuristic", 1: "heuristic", 2: "first_k", 3: "never"}  # specstream.v1.EarlyStopping


@dataclass(frozen=True)
class BeamOptions:
    """Beam search instead of one greedy sequence (target_service/beam.py). A request with these
    holds up to `num_beams` rows of the batch and returns its `num_return_sequences` best
    hypotheses. Fixed width is transformers' beam search; a finite `beam_threshold` or a
    `max_candidates_per_parent` below `num_beams` make the width variable (Freitag & Al-Onaizan)."""

    num_beams: int  # k: hypotheses kept per step, >= 1 (k = 1 is greedy decoding)
    num_return_sequences: int = 1  # 1..k: best finished hypotheses returned, best first
    length_penalty: float = 1.0  # a hypothesis scores sum(logprobs) / generated_length ** length_penalty
    early_stopping: EarlyStopping = "heuristic"
    beam_threshold: float = math.inf  # δ > 0: prune hypotheses more than δ below the best log-probability (a finished one included)
    max_candidates_per_parent: int = 0  # M: at most this many running hypotheses extend one parent; 0 = k

    def __post_init__(self) -> None:
        if self.num_beams < 1:
            raise InvalidArgumentError("beam.num_beams", self.num_beams, "must be >= 1")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise InvalidArgumentError("beam.num_return_sequences", self.num_return_sequences,
                                       f"must be in 1..num_beams ({self.num_beams})")
        if not math.isfinite(self.length_penalty):
            raise InvalidArgumentError("beam.length_penalty", self.length_penalty, "must be finite")
        if self.early_stopping not in EARLY_STOPPING:
            raise InvalidArgumentError("beam.early_stopping", self.early_stopping, f"must be one of {list(EARLY_STOPPING)}")
        if not self.beam_threshold > 0:  # NaN fails too
            raise InvalidArgumentError("beam.beam_threshold", self.beam_threshold, "must be > 0 (unset: infinity, fixed width)")
        if not 0 <= self.max_candidates_per_parent <= self.num_beams:
            raise InvalidArgumentError("beam.max_candidates_per_parent", self.max_candidates_per_parent,
                                       f"must be in 0..num_beams ({self.num_beams}); 0 = num_beams")

    @classmethod
    def from_pb(cls, pb) -> BeamOptions:
        """A `BeamSearch` message -> options: unset length_penalty is 1, unset beam_threshold
        infinity (fixed width), num_return_sequences 0 is 1."""
        early = _EARLY_STOPPING_PB.get(pb.early_stopping)
        if early is None:
            raise InvalidArgumentError("beam.early_stopping", pb.early_stopping, "unknown EarlyStopping value")
        return cls(num_beams=pb.num_beams, num_return_sequences=pb.num_return_sequences or 1,
                   length_penalty=pb.length_penalty if pb.HasField("length_penalty") else 1.0,
                   early_stopping=early,
                   beam_threshold=pb.beam_threshold if pb.HasField("beam_threshold") else math.inf,
                   max_candidates_per_parent=pb.max_candidates_per_parent)


def check_combination(*, temperature: float, top_k: int = 0, top_p: float = 1.0, fixed_speculation: bool = False,
                      logprobs: bool = False, stop_strings: int = 0, min_tokens: int = 0) -> None:
    """Beam search combines with greedy decoding only: anything else beside `beam` is
    INVALID_ARGUMENT naming it (speculation auto and off are fine: beams do not speculate)."""
    if temperature != 0.0:
        raise InvalidArgumentError("temperature", temperature, "beam search is greedy: must be 0 with beam")
    if top_k != 0:
        raise InvalidArgumentError("top_k", top_k, "beam search is greedy: must be 0 with beam")
    if top_p != 1.0:
        raise InvalidArgumentError("top_p", top_p, "beam search is greedy: must be unset (1) with beam")
    if fixed_speculation:
        raise InvalidArgumentError("speculation.mode", "FIXED", "beam search does not speculate: use AUTO or OFF")
    if logprobs:
        raise InvalidArgumentError("logprobs", True, "not available with beam (each sequence carries its score)")
    if stop_strings:
        raise InvalidArgumentError("stop", f"<{stop_strings} strings>",
                                   "stop strings are not supported with beam; use stop_token_ids")
    if min_tokens:
        raise InvalidArgumentError("min_tokens", min_tokens, "not supported with beam")
