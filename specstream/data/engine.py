"""What the target engine takes and gives back, as plain dataclasses: both ends of the
``Target.Connect`` stream speak these (the protobuf forms, both ways, live in
``specstream/data/engine_wire.py``, used only where a message crosses the wire).

In: a ``SequenceRequest`` per generation (token ids, budget, stop ids, speculation and sampling
settings), checked by specstream/data/request_rules.py wherever it is built or received. Out: one ``EngineMessage`` per connection per step, carrying a ``SequenceEvent`` for
every sequence that produced something (new tokens, log-probabilities, cumulative counters, and
finally the finish reason or an error), plus the engine's ``Load``. A target describes itself
(model, limits, load) as a ``TargetInfo``.

Knows nothing about gRPC; errors are ``specstream.data.errors`` exceptions, whose class is their status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specstream.data.batch_stats import BatchStats
from specstream.data.beam import BeamOptions, EarlyStopping
from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.errors import SpecstreamError
from specstream.data.sampling import GREEDY, SamplingParams

__all__ = ["SPECULATION_MODES", "BeamHypothesis", "BeamOptions", "EarlyStopping", "EngineMessage", "FinishReason",
           "Load", "SequenceEvent", "SequenceRequest", "SequenceStats", "Speculation", "TargetInfo", "TokenLogprob"]

SpeculationMode = Literal["auto", "off", "fixed"]
SPECULATION_MODES: tuple[SpeculationMode, ...] = ("auto", "off", "fixed")
FinishReason = Literal["length", "stop", "eos", "cancelled", "error"]


@dataclass(frozen=True)
class Speculation:
    mode: SpeculationMode = "auto"  # auto: the γ controller picks per step; off: γ = 0; fixed: `gamma`
    gamma: int = 0  # fixed mode only: proposals per step, 1..max_gamma
    max_gamma: int = 0  # auto mode only: the most the controller may pick; 0 = the engine's max_gamma


AUTO = Speculation()


@dataclass
class BeamHypothesis:
    """One of a beam request's returned hypotheses."""

    token_ids: list[int]  # generated tokens (the stop token included when it ended one)
    score: float  # sum of its log-probabilities / len(token_ids) ** length_penalty: the ranking
    logprob: float  # sum of its tokens' log-probabilities
    finish_reason: FinishReason  # "eos" / "stop" (ended by a stop id) or "length"


@dataclass
class SequenceRequest:
    id: str  # unique on its connection while running
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of these (EOS included)
    eos_token_ids: frozenset[int] = frozenset()  # the stop ids reported as finish reason "eos"
    speculation: Speculation = AUTO
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # None: not requested; n: with the n most likely alternatives
    traceparent: str = ""
    beam: BeamOptions | None = None  # beam search (greedy only: no sampling, speculation or logprobs)
    # EOS and the other stop ids are masked (cannot be generated) until this many tokens exist.
    min_tokens: int = 0
    constraint: Constraint | None = None  # what the generated tokens must match (None: free text)
    penalties: Penalties | None = None  # logit_bias, repetition, frequency, presence (None: none)
    # Prompts share cached K/V only with prompts of the same salt (specstream/data/prefix.py); the
    # gateway adds the caller's identity when callers need tokens.
    cache_salt: str = ""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # under the distribution the token came from (the plain softmax for greedy rows)
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), most likely first


@dataclass
class SequenceStats:
    """A sequence's speculation counters, cumulative."""

    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0  # proposals kept
    target_passes: int = 0  # target forwards over the sequence, prefill included
    mean_accepted_length: float = 0.0  # tokens emitted per decode pass
    rejections: int = 0  # decode passes in which a proposal was rejected
    gamma_histogram: list[int] = field(default_factory=list)  # [g]: decode passes given g proposals
    alpha_estimate: float = 0.0  # the γ controller's acceptance estimate at the last step (auto mode)
    beam_expansions: int = 0  # beam requests: hypothesis rows expanded, all steps together
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: passes that kept proposal i
    branch_histogram: list[int] = field(default_factory=list)  # [b]: decode passes given a tree of b branches
    branch_tokens: int = 0  # accepted proposals that were branches beside the chain


@dataclass
class SequenceEvent:
    id: str
    token_ids: list[int] = field(default_factory=list)  # new this step
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when requested
    finish_reason: FinishReason | None = None  # set on the sequence's last event
    stats: SequenceStats = field(default_factory=SequenceStats)
    error: SpecstreamError | None = None  # with finish_reason "error"; its class gives the status
    queue_seconds: float | None = None  # arrival -> admission, on the first event after admission
    cached_tokens: int = 0  # prompt tokens the prefix cache served, on the first event after admission
    # Beam requests: no tokens until the last event, which carries the best hypothesis' tokens in
    # `token_ids` and the n best in `sequences`, best first.
    sequences: list[BeamHypothesis] = field(default_factory=list)


@dataclass
class Load:
    max_slots: int
    free_slots: int
    running: int
    queued: int
    draft_sequences: int  # as last reported by the draft
    draft_connected: bool
    batch: BatchStats  # a snapshot of the cumulative batching counters
    draft_model: str = ""  # the draft connected now ("": none); it may connect after GetInfo


@dataclass
class EngineMessage:
    """What one connection receives after a step (or on attach: load only)."""

    load: Load
    step: int = 0
    events: list[SequenceEvent] = field(default_factory=list)


@dataclass
class TargetInfo:
    """What a target serves, as it reports itself (`Target.GetInfo`): the model, the limits a
    request must fit, and its load at the time. Unset fields read as zero, as on the wire."""

    model_name: str = ""
    vocab_size: int = 0
    max_context_length: int = 0  # prompt + generated tokens of one sequence, at most
    max_gamma: int = 0  # proposals per step, at most
    default_gamma: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    draft_model_name: str = ""  # "": no draft
    load: Load | None = None  # None: not reported
