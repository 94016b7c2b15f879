"""One generation request inside the target engine: its tokens, budget, slot and counters.

A beam request is one ``Sequence`` too (the request group): its hypotheses live in
``beam`` (target_service/beam.py), one KV slot each out of the k it holds from admission to the
end (``beam_slots``); ``tokens`` stays the prompt until the search ends with the best hypothesis.

Knows nothing about the model, the draft or gRPC: it is built from a ``SequenceRequest`` and
reports ``SequenceEvent``s (specstream/data/engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import INVALID_SPAN

from specstream.data.engine import (
    BeamHypothesis,
    FinishReason,
    SequenceEvent,
    SequenceRequest,
    SequenceStats,
    TokenLogprob,
)
from specstream.data.constraint import Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.data.propose import SOURCE
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.text.grammar import GrammarError, Matcher
from target_service.beam import BeamSearch
from target_service.penalties import PenaltyState
from target_service.settle import VerifyRow


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
    gamma: int  # proposals per step: fixed (>= 1), 0 = plain decoding, gamma.AUTO_GAMMA = the controller's choice
    max_gamma: int = 0  # the most the controller may pick (auto)
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # None: not requested; n: with the n most likely alternatives
    min_tokens: int = 0  # the stop ids are masked until this many tokens are generated
    # A constrained request's place in its grammar, at the committed tokens (target_service/grammar_rows.py).
    matcher: Matcher | None = None
    constraint: Constraint | None = None  # its source, sent to the draft with the sequence's first item
    # Its penalties with the committed tokens' counts, applied at every verified position (target_service/penalties.py).
    penalties: PenaltyState | None = None
    traceparent: str = ""
    arrival: float = field(default_factory=time.monotonic)
    slot: int | None = None
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # with finish_reason "error"
    queue_seconds: float | None = None  # set at admission, reported once
    prefilled: int = 0  # prompt tokens in the cache so far (chunked prefill)
    cache_salt: str = ""  # shares cached prefixes only with the same salt (specstream/models/prefix_cache.py)
    cached_tokens: int = 0  # prompt tokens the prefix cache served, reported once
    reused: int = 0  # prompt tokens the prefix cache served (kept: the draft is told, ProposeItem.cached_prefix)
    prompt_keys: list[bytes] | None = None  # its prompt's full blocks' keys (specstream/data/prefix.py), once asked
    last_expanded: int = 0  # the engine step that last advanced this sequence (starvation bound)
    span: Any = INVALID_SPAN  # its tracing span (target_service/tracing.py); non-recording unless tracing
    # For a draft that reads the target's features: the bytes (bfloat16) of the target's features of
    # positions 0..len(tokens)-2 while the sequence runs, appended on the compute thread as they are
    # committed (the verify appends them before the event loop appends the tokens; nothing reads
    # them in between); None when not kept (speculation off, no such draft attached when it was
    # prefilled, or the draft refused them: it then decodes without that draft).
    features: bytearray | None = None
    # Speculation counters (cumulative).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    decode_passes: int = 0
    rejections: int = 0  # decode passes in which a proposal was rejected
    gamma_histogram: list[int] = field(default_factory=list)  # [g]: decode passes given g proposals
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: decode passes that kept proposal i
    branch_histogram: list[int] = field(default_factory=list)  # [b]: decode passes given a tree of b branches
    branch_tokens: int = 0  # accepted proposals that were branches
    alpha_estimate: float = 0.0  # the controller's estimate at the last step (auto)
    pending: list[int] = field(default_factory=list)  # tokens not yet sent in an event
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # in step with `pending`
    max_token: int = 0  # largest id in `tokens` (a draft with a smaller vocabulary cannot take it)
    # Beam requests only.
    beam: BeamSearch | None = None
    beam_slots: list[int] = field(default_factory=list)  # the k slots it holds (the first is `slot`, the prompt's)
    hypothesis_slots: list[int] = field(default_factory=list)  # per running hypothesis, in beam.running's order
    sequences: list[BeamHypothesis] = field(default_factory=list)  # the results, once the search has ended

    def __post_init__(self) -> None:
        self.max_token = max(self.tokens, default=0)

    @classmethod
    def from_request(cls, seq_id: int, conn: Any, req: SequenceRequest, gamma: int, max_gamma: int) -> Sequence:
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
            max_gamma=max_gamma,
            sampling=req.sampling,
            logprobs=req.logprobs,
            min_tokens=req.min_tokens,
            constraint=req.constraint,
            penalties=PenaltyState(req.penalties, req.prompt_token_ids) if req.penalties is not None else None,
            traceparent=req.traceparent,
            cache_salt=req.cache_salt,
            beam=(BeamSearch(req.beam, req.max_new_tokens, frozenset(req.stop_token_ids), frozenset(req.eos_token_ids))
                  if req.beam is not None else None),
        )

    @property
    def length(self) -> int:
        """What the scheduler's min_length / fifo selections compare: tokens so far, prompt
        included; for a beam, the tokens its hypotheses have generated (VAR-STREAM's l_t, the
        decoder length: beams admitted later catch up whatever their prompts' lengths)."""
        if self.beam is not None:
            return self.beam.generated
        return len(self.tokens)

    @property
    def width(self) -> int:
        """Rows it takes in a decode step: a beam's running hypotheses, else 1."""
        return self.beam.width if self.beam is not None else 1

    @property
    def slots_needed(self) -> int:
        return self.beam.k if self.beam is not None else 1

    def end_search(self) -> None:
        """A beam whose search has ended: its tokens become the best hypothesis', reported with
        the n best."""
        assert self.beam is not None
        self.sequences = self.beam.results()
        best = self.sequences[0] if self.sequences else None
        if best is not None:
            self.tokens.extend(best.token_ids)
            self.pending.extend(best.token_ids)
            self.max_token = max(self.tokens)
        self.finish_reason = best.finish_reason if best is not None else "length"

    @property
    def masked_until(self) -> int:
        """No stop id may land at a position before this one (min_tokens): prompt + min_tokens."""
        return self.prompt_len + self.min_tokens

    def verify_row(self, source: str = SOURCE) -> VerifyRow:
        """The row this pass verifies for the sequence, before any proposal: its sampling
        settings, the position its first token lands at and, while min_tokens is not reached,
        the stop ids masked there."""
        masked = self.stop_ids if len(self.tokens) < self.masked_until else frozenset()
        return VerifyRow(self.sampling, len(self.tokens), logprobs=self.logprobs, source=source, masked_ids=masked,
                         masked_until=self.masked_until if masked else 0, penalties=self.penalties)

    def first_row(self) -> VerifyRow:
        """The row of the prefill pass that gives the first token: ``verify_row`` with, for a
        constrained sequence, the grammar's mask at the start."""
        row = self.verify_row()
        if self.matcher is not None:
            row.grammar_mask = self.matcher.mask()[None]
        return row

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated

    def append(self, new_tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None) -> None:
        """Commits tokens (with their log-probabilities when the request asked), cut at the first
        stop id (kept) or at the budget (docs/architecture.md §7: EOS, stop or max_new_tokens inside an
        accepted run end the sequence there). A constrained sequence's matcher takes them too; a
        grammar that allows nothing more ends it ("stop"); one that is cut by the budget before it
        may end stays "length"."""
        if self.matcher is not None:
            try:
                new_tokens = self._through_grammar(new_tokens)
            except GrammarError as err:  # llguidance's limits reached here: this sequence ends, not the batch
                assert self.constraint is not None
                self.finish_reason = "error"
                self.error = InvalidArgumentError(self.constraint.field, "<source>",
                                                  f"the grammar went past its parser's limits after "
                                                  f"{self.generated} tokens: {err}")
                return
        self._commit(new_tokens, logprobs)
        if self.matcher is not None and self.finish_reason is None and self.matcher.stopped:
            self.finish_reason = "stop"

    def _through_grammar(self, new_tokens: list[int]) -> list[int]:
        """The tokens to commit, each taken by the matcher: up to the budget, a stop id, or the
        grammar's end (a run verified past it, e.g. EOS as the bonus, is not the output)."""
        assert self.matcher is not None
        out = []
        for tok in new_tokens[: self.remaining]:
            if self.matcher.consume([tok]) != 1:  # the masks allowed every one, unless the matcher failed
                if self.matcher.failed is not None:
                    raise GrammarError(self.matcher.failed)
                raise RuntimeError(f"sequence {self.seq_id}: its grammar refused committed token {tok}")
            out.append(tok)
            if tok in self.stop_ids or self.matcher.stopped:
                break
        return out

    def _commit(self, new_tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]] | None) -> None:
        for i, tok in enumerate(new_tokens[: self.remaining]):
            self.tokens.append(tok)
            self.pending.append(tok)
            if logprobs is not None:
                chosen, top = logprobs[i]
                self.pending_logprobs.append(TokenLogprob(tok, chosen, top))
            self.max_token = max(self.max_token, tok)
            if self.penalties is not None:
                self.penalties.take(tok)
            if tok in self.stop_ids:
                self.finish_reason = "eos" if tok in self.eos_ids else "stop"
                return
        if self.remaining <= 0:
            self.finish_reason = "length"

    def record_decode(self, proposed: int, accepted: int, branches: int = 0, from_branches: int = 0) -> None:
        """A decode pass that verified a chain of `proposed` proposals (and `branches` beside it)
        and kept `accepted`, the last `from_branches` of them off the chain."""
        self.decode_passes += 1
        if branches >= len(self.branch_histogram):
            self.branch_histogram.extend([0] * (branches + 1 - len(self.branch_histogram)))
        self.branch_histogram[branches] += 1
        self.branch_tokens += from_branches
        if proposed >= len(self.gamma_histogram):
            self.gamma_histogram.extend([0] * (proposed + 1 - len(self.gamma_histogram)))
        self.gamma_histogram[proposed] += 1
        if accepted > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def stats(self) -> SequenceStats:
        emitted = max(self.generated - 1, 0)  # the first token comes from prefill, not a decode pass
        return SequenceStats(
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            target_passes=self.target_passes,
            mean_accepted_length=emitted / self.decode_passes if self.decode_passes else 0.0,
            rejections=self.rejections,
            gamma_histogram=list(self.gamma_histogram),
            alpha_estimate=self.alpha_estimate,
            beam_expansions=self.beam.expansions if self.beam is not None else 0,
            accepted_per_position=list(self.accepted_per_position),
            branch_histogram=list(self.branch_histogram),
            branch_tokens=self.branch_tokens,
        )

    def event(self) -> SequenceEvent:
        """The step's event: new tokens since the last one, and the finish reason once ended."""
        event = SequenceEvent(self.request_id, self.pending, self.pending_logprobs, self.finish_reason,
                              self.stats(), self.error, self.queue_seconds, self.cached_tokens, self.sequences)
        self.pending, self.pending_logprobs, self.queue_seconds, self.sequences = [], [], None, []
        self.cached_tokens = 0
        return event
