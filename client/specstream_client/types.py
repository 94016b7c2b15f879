"""Plain result types of the specstream client SDK, converted from the protobuf messages.

Contract: ``from_pb`` constructors copy everything the client needs out of the generated messages,
so callers never touch protobuf. Finish reasons are lower-case strings: "length", "stop", "eos",
"cancelled", "error", "tool_calls" (the answer ended after calling tools); a response that
(wrongly) carries none gives "unspecified" in a ``GenerateResult`` and ``None`` in a non-final
``StreamChunk``; an enum value newer than this SDK gives "unknown". ``logprobs`` is a list aligned
1:1 with ``token_ids`` when the request asked for
logprobs, and empty otherwise; ``seed`` is the seed the server used (chosen by it when the request
set none), on a ``GenerateResult`` and on the final ``StreamChunk``. A beam-search request's
``sequences`` are its n best hypotheses (``BeamSequence``), best first, on the result and on the
final (only) chunk; its ``text``/``token_ids`` are the best one's.

What it does not know: token text (``token_ids`` are raw ids; ``text`` is the server's
detokenization), and anything the server did not send (missing sub-messages read as zeros in a
unary result and as ``None`` in a stream chunk).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from specstream_pb import common_pb2, generation_pb2

__all__ = [
    "BeamSequence",
    "FINISH_REASONS",
    "GenerateResult",
    "Sample",
    "Logprob",
    "ModelInfo",
    "SpeculationStats",
    "StreamChunk",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "Usage",
    "finish_reason_name",
]

FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_EOS: "eos",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def finish_reason_name(value: int) -> str | None:
    """The SDK's name for a FinishReason value; None for UNSPECIFIED (still running)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FINISH_REASONS.get(value, "unknown")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those the server's prefix cache served (not recomputed)

    @classmethod
    def from_pb(cls, msg: common_pb2.Usage) -> Usage:
        return cls(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                   cached_tokens=msg.cached_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    mean_accepted_length: float = 0.0
    rejections: int = 0
    # gamma_histogram[g]: decode passes in which the request was given g proposals (automatic
    # speculation picks g per step); alpha_estimate: the server's final acceptance estimate.
    gamma_histogram: tuple[int, ...] = ()
    alpha_estimate: float = 0.0
    beam_expansions: int = 0  # beam search: hypothesis rows the server expanded for the request
    # branch_histogram[b]: decode passes whose proposal was a tree with b branches beside its chain
    # (0: a chain); branch_tokens: accepted proposals that were branches, not the draft's chain.
    branch_histogram: tuple[int, ...] = ()
    branch_tokens: int = 0

    @classmethod
    def from_pb(cls, msg: common_pb2.SpeculationStats) -> SpeculationStats:
        return cls(
            draft_tokens=msg.draft_tokens,
            accepted_tokens=msg.accepted_tokens,
            target_passes=msg.target_passes,
            mean_accepted_length=msg.mean_accepted_length,
            rejections=msg.rejections,
            gamma_histogram=tuple(msg.gamma_histogram),
            alpha_estimate=msg.alpha_estimate,
            beam_expansions=msg.beam_expansions,
            branch_histogram=tuple(msg.branch_histogram),
            branch_tokens=msg.branch_tokens,
        )

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted, or 0.0 when nothing was drafted. Proposals after a rejection in
        the same step count as not accepted, so this is below the per-token `alpha`."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability (Leviathan et al.'s α), estimated as
        accepted / (accepted + rejections); 0.0 when nothing was drafted."""
        trials = self.accepted_tokens + self.rejections
        return self.accepted_tokens / trials if trials else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["alpha"] = self.alpha
        return d


@dataclass(frozen=True, slots=True)
class Timings:
    queue_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    total_seconds: float = 0.0

    @classmethod
    def from_pb(cls, msg: common_pb2.Timings) -> Timings:
        return cls(
            queue_seconds=msg.queue_seconds,
            time_to_first_token_seconds=msg.time_to_first_token_seconds,
            total_seconds=msg.total_seconds,
        )


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was chosen from (for
    greedy requests, the plain softmax), and the most likely alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[Logprob, ...] = ()

    @classmethod
    def from_pb(cls, msg: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(
            token_id=msg.token_id,
            logprob=msg.logprob,
            top=tuple(Logprob(token_id=t.token_id, logprob=t.logprob) for t in msg.top),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [t.to_dict() for t in self.top]}


@dataclass(frozen=True, slots=True)
class BeamSequence:
    """One hypothesis of a beam search: its text and tokens, its score (sum of log-probabilities /
    length ** length_penalty, the ranking), the plain sum, and why it ended ("eos", "stop", "length")."""

    text: str
    token_ids: list[int]
    score: float
    logprob: float
    finish_reason: str

    @classmethod
    def from_pb(cls, msg: common_pb2.BeamSequence) -> BeamSequence:
        return cls(text=msg.text, token_ids=list(msg.token_ids), score=msg.score, logprob=msg.logprob,
                   finish_reason=finish_reason_name(msg.finish_reason) or "unspecified")

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": list(self.token_ids), "score": self.score, "logprob": self.logprob,
                "finish_reason": self.finish_reason}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (with ``tools``): the function's name and its arguments as a JSON
    object's text, valid against the function's parameters. Pass it back in an assistant message's
    ``tool_calls`` with the result in a ``tool`` message."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_pb(cls, msg: generation_pb2.ToolCall) -> ToolCall:
        return cls(id=msg.id, name=msg.name, arguments=msg.arguments)

    def parsed_arguments(self) -> Any:
        """The arguments as Python values."""
        return json.loads(self.arguments)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class Sample:
    """One of a request's ``n`` samples: its answer, usage (the shared prompt, its own completion
    tokens), speculation counts and seed (the request's seed + index)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage = field(default_factory=Usage)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    seed: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_pb(cls, msg: generation_pb2.Sample) -> Sample:
        return cls(index=msg.index, text=msg.text, token_ids=list(msg.token_ids),
                   finish_reason=finish_reason_name(msg.finish_reason) or "unspecified", usage=Usage.from_pb(msg.usage),
                   stats=SpeculationStats.from_pb(msg.stats), seed=msg.seed,
                   logprobs=[TokenLogprob.from_pb(lp) for lp in msg.logprobs],
                   tool_calls=[ToolCall.from_pb(c) for c in msg.tool_calls])

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "text": self.text, "token_ids": list(self.token_ids),
                             "finish_reason": self.finish_reason, "usage": asdict(self.usage),
                             "stats": self.stats.to_dict(), "seed": self.seed}
        if self.logprobs:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return d


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage = field(default_factory=Usage)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    timings: Timings = field(default_factory=Timings)
    seed: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sequences: list[BeamSequence] = field(default_factory=list)  # beam search: the n best, best first
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls made (outside ``text``)
    # n > 1: every sample, by index (text, token_ids... above are the first's; usage counts the
    # prompt once and every sample's completion tokens).
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def from_pb(cls, msg: generation_pb2.GenerateResponse) -> GenerateResult:
        return cls(
            request_id=msg.request_id,
            text=msg.text,
            token_ids=list(msg.token_ids),
            finish_reason=finish_reason_name(msg.finish_reason) or "unspecified",
            usage=Usage.from_pb(msg.usage),
            stats=SpeculationStats.from_pb(msg.stats),
            timings=Timings.from_pb(msg.timings),
            seed=msg.seed,
            logprobs=[TokenLogprob.from_pb(lp) for lp in msg.logprobs],
            sequences=[BeamSequence.from_pb(b) for b in msg.sequences],
            tool_calls=[ToolCall.from_pb(c) for c in msg.tool_calls],
            samples=[Sample.from_pb(s) for s in msg.samples],
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: nested dicts, stats with acceptance_rate; "logprobs", "sequences",
        "tool_calls" and "samples" only when there are any."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": asdict(self.usage),
            "stats": self.stats.to_dict(),
            "timings": asdict(self.timings),
            "seed": self.seed,
        }
        if self.logprobs:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.sequences:
            d["sequences"] = [b.to_dict() for b in self.sequences]
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.samples:
            d["samples"] = [s.to_dict() for s in self.samples]
        return d


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One streamed delta. ``logprobs`` belong to this chunk's ``token_ids`` (empty unless
    requested). ``finish_reason``/``usage``/``stats``/``timings``/``seed`` are set on the last
    chunk only (None before). With n > 1, ``index`` says whose sample a chunk is part of: each
    sample's chunks come in order, interleaved with the others', and each sample's last chunk is final."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: SpeculationStats | None = None
    timings: Timings | None = None
    seed: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sequences: list[BeamSequence] = field(default_factory=list)  # beam search, final chunk: the n best
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls that closed in this chunk
    index: int = 0  # n > 1: the sample this chunk is part of

    @classmethod
    def from_pb(cls, msg: generation_pb2.GenerateStreamResponse) -> StreamChunk:
        finish_reason = finish_reason_name(msg.finish_reason)
        return cls(
            request_id=msg.request_id,
            text=msg.text,
            token_ids=list(msg.token_ids),
            finish_reason=finish_reason,
            usage=Usage.from_pb(msg.usage) if msg.HasField("usage") else None,
            stats=SpeculationStats.from_pb(msg.stats) if msg.HasField("stats") else None,
            timings=Timings.from_pb(msg.timings) if msg.HasField("timings") else None,
            # uint64 has no presence: 0 is a real seed on the final chunk, "not sent" before it.
            seed=msg.seed if finish_reason is not None else None,
            logprobs=[TokenLogprob.from_pb(lp) for lp in msg.logprobs],
            sequences=[BeamSequence.from_pb(b) for b in msg.sequences],
            tool_calls=[ToolCall.from_pb(c) for c in msg.tool_calls],
            index=msg.index,
        )

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; "logprobs" only when this chunk has any."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": asdict(self.usage) if self.usage is not None else None,
            "stats": self.stats.to_dict() if self.stats is not None else None,
            "timings": asdict(self.timings) if self.timings is not None else None,
            "seed": self.seed,
        }
        if self.index:
            d["index"] = self.index
        if self.logprobs:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.sequences:
            d["sequences"] = [b.to_dict() for b in self.sequences]
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return d


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the gateway serves, plus live load counters. ``draft_model`` is "" without a draft."""

    target_model: str
    draft_model: str
    vocab_size: int
    max_context_length: int
    max_new_tokens_limit: int
    max_gamma: int
    default_gamma: int
    eos_token_ids: list[int]
    running_sequences: int = 0
    queued_sequences: int = 0
    free_slots: int = 0
    draft_sequences: int = 0
    draft_connected: bool = False
    gateway_in_flight: int = 0
    has_chat_template: bool = False  # `chat()` is accepted

    @classmethod
    def from_pb(cls, msg: generation_pb2.ModelInfo) -> ModelInfo:
        return cls(
            target_model=msg.target_model,
            draft_model=msg.draft_model,
            vocab_size=msg.vocab_size,
            max_context_length=msg.max_context_length,
            max_new_tokens_limit=msg.max_new_tokens_limit,
            max_gamma=msg.max_gamma,
            default_gamma=msg.default_gamma,
            eos_token_ids=list(msg.eos_token_ids),
            running_sequences=msg.running_sequences,
            queued_sequences=msg.queued_sequences,
            free_slots=msg.free_slots,
            draft_sequences=msg.draft_sequences,
            draft_connected=msg.draft_connected,
            gateway_in_flight=msg.gateway_in_flight,
            has_chat_template=msg.has_chat_template,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
