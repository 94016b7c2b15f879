"""One generation request inside the target engine: its tokens, budget, slot and counters.

Knows nothing about the model or gRPC streams; `from_pb` / `event_pb` are the protobuf edge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import INVALID_SPAN

from specstream.sampling import GREEDY, SamplingParams
from specstream_pb import common_pb2, target_pb2

FINISH = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "eos": common_pb2.FINISH_REASON_EOS,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


@dataclass(eq=False)  # identity semantics: sequences are hashed by object
class Sequence:
    seq_id: int  # engine-wide id, also the draft's key
    request_id: str  # the gateway's id, unique on its connection
    conn: Any  # the Connection whose stream gets this sequence's events
    tokens: list[int]  # prompt + generated
    prompt_len: int
    max_new_tokens: int
    stop_ids: frozenset[int]  # generation ends after any of these (EOS included)
    eos_ids: frozenset[int]  # the stop ids reported as finish reason "eos"
    gamma: int  # proposals per step; 0 = plain decoding
    sampling: SamplingParams = GREEDY
    sampling_pb: common_pb2.Sampling = field(default_factory=common_pb2.Sampling)  # forwarded to the draft
    logprobs: int | None = None  # None: not requested; n: with the n most likely alternatives
    traceparent: str = ""
    arrival: float = field(default_factory=time.monotonic)
    slot: int | None = None
    draft_len: int = 0  # leading tokens the draft holds that agree with `tokens`
    draft_epoch: int = -1  # the draft stream the above refers to
    finish_reason: str | None = None
    queue_seconds: float | None = None  # set at admission, reported once
    prefilled: int = 0  # prompt tokens in the cache so far (chunked prefill)
    last_expanded: int = 0  # the engine step that last advanced this sequence (starvation bound)
    span: Any = INVALID_SPAN  # its tracing span (target_service/tracing.py); non-recording unless tracing
    # Speculation counters (cumulative).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    decode_passes: int = 0
    rejections: int = 0  # decode passes in which a proposal was rejected
    pending: list[int] = field(default_factory=list)  # tokens not yet sent in an event
    pending_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # in step with `pending`
    max_token: int = 0  # largest id in `tokens` (a draft with a smaller vocabulary cannot take it)

    def __post_init__(self) -> None:
        self.max_token = max(self.tokens, default=0)

    @classmethod
    def from_pb(cls, seq_id: int, conn: Any, req: target_pb2.SequenceRequest, gamma: int,
                sampling: SamplingParams) -> Sequence:
        return cls(
            seq_id=seq_id,
            request_id=req.id,
            conn=conn,
            tokens=list(req.prompt_token_ids),
            prompt_len=len(req.prompt_token_ids),
            max_new_tokens=req.max_new_tokens,
            stop_ids=frozenset(req.stop_token_ids),
            eos_ids=frozenset(req.eos_token_ids),
            gamma=gamma,
            sampling=sampling,
            sampling_pb=req.sampling,
            logprobs=req.top_logprobs if req.logprobs else None,
            traceparent=req.traceparent,
        )

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated

    def append(self, new_tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None) -> None:
        """Commits tokens (with their log-probabilities when the request asked), cut at the first
        stop id (kept) or at the budget (design §5: EOS, stop or max_new_tokens inside an
        accepted run end the sequence there)."""
        for i, tok in enumerate(new_tokens[: self.remaining]):
            self.tokens.append(tok)
            self.pending.append(tok)
            if logprobs is not None:
                chosen, top = logprobs[i]
                self.pending_logprobs.append(common_pb2.TokenLogprob(
                    token_id=tok, logprob=chosen, top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in top]))
            self.max_token = max(self.max_token, tok)
            if tok in self.stop_ids:
                self.finish_reason = "eos" if tok in self.eos_ids else "stop"
                return
        if self.remaining <= 0:
            self.finish_reason = "length"

    def stats_pb(self) -> common_pb2.SpeculationStats:
        emitted = max(self.generated - 1, 0)  # the first token comes from prefill, not a decode pass
        return common_pb2.SpeculationStats(
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            target_passes=self.target_passes,
            mean_accepted_length=emitted / self.decode_passes if self.decode_passes else 0.0,
            rejections=self.rejections,
        )

    def event_pb(self) -> target_pb2.SequenceEvent:
        """The step's event: new tokens since the last one, and the finish reason once ended."""
        event = target_pb2.SequenceEvent(id=self.request_id, token_ids=self.pending, stats=self.stats_pb(),
                                         logprobs=self.pending_logprobs)
        self.pending, self.pending_logprobs = [], []
        if self.finish_reason is not None:
            event.finish_reason = FINISH[self.finish_reason]
        if self.queue_seconds is not None:
            event.queue_seconds = self.queue_seconds
            self.queue_seconds = None
        return event
