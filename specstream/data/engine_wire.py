"""The protobuf forms of the target engine's messages (specstream/data/engine.py), both ways: the one
place where the plain messages of the ``Target.Connect`` stream meet ``target_pb2`` / ``common_pb2``.

The target reads requests (``request_from_pb``) and writes events and loads (``message_to_pb``,
``load_to_pb``); the gateway writes requests (``request_to_pb``) and reads events, loads and the
target's info (``event_from_pb``, ``load_from_pb``, ``info_from_pb``). For every message,
``x_from_pb(x_to_pb(v)) == v``, floats held as float32 on the wire (sampling and beam settings,
log-probabilities) being float32 values already; the event's ``queue_seconds`` is the one field
without presence on the wire: ``None`` and ``0.0`` both read back as ``None``.

A request that cannot be converted (e.g. sampling settings out of range) raises InvalidArgumentError
naming the field as the request spells it (``sampling.top_p``). An error travels as its status code
and message (``SequenceError``) and comes back as the class that code belongs to
(``specstream.data.errors.from_status``). Knows nothing about gRPC calls or streams.
"""

from __future__ import annotations

import math

from specstream.data.batch_stats import BatchStats
from specstream.data.beam import BeamOptions
from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.engine import (
    BeamHypothesis,
    EngineMessage,
    FinishReason,
    Load,
    SequenceEvent,
    SequenceRequest,
    SequenceStats,
    Speculation,
    TargetInfo,
    TokenLogprob,
)
from specstream.data.errors import InternalError, InvalidArgumentError, SpecstreamError, from_status, status_code
from specstream.data.sampling import SamplingParams
from specstream_pb import common_pb2, target_pb2

__all__ = ["batch_stats_from_pb", "batch_stats_to_pb", "beam_to_pb", "error_from_pb", "error_to_pb", "event_from_pb",
           "event_to_pb", "finish_reason_from_pb", "finish_reason_to_pb", "hypothesis_from_pb", "hypothesis_to_pb",
           "info_from_pb", "info_to_pb", "load_from_pb", "load_to_pb", "logprob_from_pb", "logprob_to_pb",
           "message_to_pb", "request_from_pb", "request_to_pb", "sampling_to_pb", "speculation_from_pb",
           "speculation_to_pb", "stats_from_pb", "stats_to_pb"]

_MODES = {
    common_pb2.SPECULATION_MODE_AUTO: "auto",
    common_pb2.SPECULATION_MODE_OFF: "off",
    common_pb2.SPECULATION_MODE_FIXED: "fixed",
}
_MODES_PB = {mode: pb for pb, mode in _MODES.items()}
_FINISH_PB: dict[FinishReason, int] = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "eos": common_pb2.FINISH_REASON_EOS,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_FINISH: dict[int, FinishReason | None] = {pb: reason for reason, pb in _FINISH_PB.items()}
_FINISH[common_pb2.FINISH_REASON_UNSPECIFIED] = None  # still running
# BeamOptions.from_pb reads the enum (unspecified = heuristic); this writes each literal's own value.
_EARLY_STOPPING_PB = {"heuristic": common_pb2.EARLY_STOPPING_HEURISTIC, "first_k": common_pb2.EARLY_STOPPING_FIRST_K,
                      "never": common_pb2.EARLY_STOPPING_NEVER}


# --- requests ---------------------------------------------------------------------------------------------

def speculation_from_pb(pb: common_pb2.Speculation) -> Speculation:
    mode = _MODES.get(pb.mode)
    if mode is None:
        raise InvalidArgumentError("speculation.mode", pb.mode,
                                   f"unknown mode; use one of {list(common_pb2.SpeculationMode.keys())}")
    return Speculation(mode, pb.gamma, pb.max_gamma)


def speculation_to_pb(speculation: Speculation) -> common_pb2.Speculation:
    return common_pb2.Speculation(mode=_MODES_PB[speculation.mode], gamma=speculation.gamma,
                                  max_gamma=speculation.max_gamma)


def sampling_to_pb(sampling: SamplingParams) -> common_pb2.Sampling:
    """The inverse of `SamplingParams.from_pb` (specstream/data/sampling.py)."""
    return common_pb2.Sampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                               seed=sampling.seed)


def beam_to_pb(beam: BeamOptions) -> common_pb2.BeamSearch:
    """The inverse of `BeamOptions.from_pb` (specstream/data/beam.py): an infinite threshold (fixed
    width) is left unset."""
    pb = common_pb2.BeamSearch(num_beams=beam.num_beams, num_return_sequences=beam.num_return_sequences,
                               length_penalty=beam.length_penalty,
                               early_stopping=_EARLY_STOPPING_PB[beam.early_stopping],
                               max_candidates_per_parent=beam.max_candidates_per_parent)
    if beam.beam_threshold != math.inf:
        pb.beam_threshold = beam.beam_threshold
    return pb


def request_from_pb(pb: target_pb2.SequenceRequest) -> SequenceRequest:
    speculation = speculation_from_pb(pb.speculation)
    try:
        sampling = SamplingParams.from_pb(pb.sampling)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"sampling.{exc.field}", exc.value, exc.reason) from exc
    return SequenceRequest(
        id=pb.id,
        prompt_token_ids=list(pb.prompt_token_ids),
        max_new_tokens=pb.max_new_tokens,
        stop_token_ids=frozenset(pb.stop_token_ids),
        eos_token_ids=frozenset(pb.eos_token_ids),
        speculation=speculation,
        sampling=sampling,
        logprobs=pb.top_logprobs if pb.logprobs else None,
        traceparent=pb.traceparent,
        beam=BeamOptions.from_pb(pb.beam) if pb.HasField("beam") else None,
        min_tokens=pb.min_tokens,
        constraint=Constraint.from_pb(pb.constraint) if pb.HasField("constraint") else None,
        penalties=Penalties.from_pb(pb.penalties) if pb.HasField("penalties") else None,
        cache_salt=pb.cache_salt,
    )


def request_to_pb(request: SequenceRequest) -> target_pb2.SequenceRequest:
    pb = target_pb2.SequenceRequest(
        id=request.id, prompt_token_ids=request.prompt_token_ids, max_new_tokens=request.max_new_tokens,
        stop_token_ids=sorted(request.stop_token_ids), eos_token_ids=sorted(request.eos_token_ids),
        speculation=speculation_to_pb(request.speculation), sampling=sampling_to_pb(request.sampling),
        logprobs=request.logprobs is not None, top_logprobs=request.logprobs or 0, traceparent=request.traceparent,
        min_tokens=request.min_tokens, cache_salt=request.cache_salt)
    if request.beam is not None:
        pb.beam.CopyFrom(beam_to_pb(request.beam))
    if request.constraint is not None:
        pb.constraint.CopyFrom(request.constraint.to_pb())
    if request.penalties is not None:
        pb.penalties.CopyFrom(request.penalties.to_pb())
    return pb


# --- events -----------------------------------------------------------------------------------------------

def finish_reason_to_pb(reason: FinishReason | None) -> int:
    """A `common_pb2.FinishReason` value; None (still running) is FINISH_REASON_UNSPECIFIED."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (still running); a value newer than this build is "error"
    (the sequence has ended, and not in a way this side understands)."""
    return _FINISH.get(value, "error")


def stats_to_pb(stats: SequenceStats) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens, target_passes=stats.target_passes,
        mean_accepted_length=stats.mean_accepted_length, rejections=stats.rejections,
        gamma_histogram=stats.gamma_histogram, alpha_estimate=stats.alpha_estimate,
        beam_expansions=stats.beam_expansions, accepted_per_position=stats.accepted_per_position,
        branch_histogram=stats.branch_histogram, branch_tokens=stats.branch_tokens)


def stats_from_pb(pb: common_pb2.SpeculationStats) -> SequenceStats:
    return SequenceStats(
        draft_tokens=pb.draft_tokens, accepted_tokens=pb.accepted_tokens, target_passes=pb.target_passes,
        mean_accepted_length=pb.mean_accepted_length, rejections=pb.rejections,
        gamma_histogram=list(pb.gamma_histogram), alpha_estimate=pb.alpha_estimate,
        beam_expansions=pb.beam_expansions, accepted_per_position=list(pb.accepted_per_position),
        branch_histogram=list(pb.branch_histogram), branch_tokens=pb.branch_tokens)


def logprob_to_pb(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob,
                                   top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in logprob.top])


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.logprob, [(alt.token_id, alt.logprob) for alt in pb.top])


def hypothesis_to_pb(hypothesis: BeamHypothesis) -> common_pb2.BeamSequence:
    """Without text: the gateway detokenizes."""
    return common_pb2.BeamSequence(token_ids=hypothesis.token_ids, score=hypothesis.score,
                                   logprob=hypothesis.logprob, finish_reason=_FINISH_PB[hypothesis.finish_reason])


def hypothesis_from_pb(pb: common_pb2.BeamSequence) -> BeamHypothesis:
    return BeamHypothesis(list(pb.token_ids), pb.score, pb.logprob, finish_reason_from_pb(pb.finish_reason))


def error_to_pb(error: SpecstreamError) -> common_pb2.SequenceError:
    return common_pb2.SequenceError(code=error.code.value[0], message=str(error))


def error_from_pb(pb: common_pb2.SequenceError) -> SpecstreamError:
    """The error the other side sent, as the class its code belongs to."""
    return from_status(status_code(pb.code), pb.message)


def event_to_pb(event: SequenceEvent) -> target_pb2.SequenceEvent:
    pb = target_pb2.SequenceEvent(
        id=event.id, token_ids=event.token_ids, stats=stats_to_pb(event.stats),
        logprobs=[logprob_to_pb(lp) for lp in event.logprobs],
        sequences=[hypothesis_to_pb(h) for h in event.sequences], cached_tokens=event.cached_tokens)
    if event.finish_reason is not None:
        pb.finish_reason = _FINISH_PB[event.finish_reason]
    if event.error is not None:
        pb.error.CopyFrom(error_to_pb(event.error))
    if event.queue_seconds is not None:
        pb.queue_seconds = event.queue_seconds
    return pb


def event_from_pb(pb: target_pb2.SequenceEvent) -> SequenceEvent:
    """An event ending in "error" always carries an error: an INTERNAL one if the sender gave none."""
    finish = finish_reason_from_pb(pb.finish_reason)
    error = error_from_pb(pb.error) if pb.HasField("error") else None
    if finish == "error" and error is None:
        error = InternalError(f"sequence {pb.id!r} ended with finish reason {pb.finish_reason} and no error")
    return SequenceEvent(
        id=pb.id, token_ids=list(pb.token_ids), logprobs=[logprob_from_pb(lp) for lp in pb.logprobs],
        finish_reason=finish, stats=stats_from_pb(pb.stats), error=error, queue_seconds=pb.queue_seconds or None,
        cached_tokens=pb.cached_tokens, sequences=[hypothesis_from_pb(s) for s in pb.sequences])


# --- load and info ----------------------------------------------------------------------------------------

def batch_stats_to_pb(stats: BatchStats) -> common_pb2.BatchStats:
    return common_pb2.BatchStats(
        policy=stats.policy, max_batch=stats.max_batch, steps=stats.steps, row_expansions=stats.row_expansions,
        tokens_processed=stats.tokens_processed, padded_tokens=stats.padded_tokens,
        prefill_tokens=stats.prefill_tokens, queued_steps=stats.queued_steps, queued_rows=stats.queued_rows,
        admitted=stats.admitted, queue_seconds=stats.queue_seconds, occupancy=stats.occupancy)


def batch_stats_from_pb(pb: common_pb2.BatchStats) -> BatchStats:
    stats = BatchStats(
        policy=pb.policy, max_batch=pb.max_batch, steps=pb.steps, row_expansions=pb.row_expansions,
        tokens_processed=pb.tokens_processed, padded_tokens=pb.padded_tokens, prefill_tokens=pb.prefill_tokens,
        queued_steps=pb.queued_steps, queued_rows=pb.queued_rows, admitted=pb.admitted,
        queue_seconds=pb.queue_seconds)
    stats.occupancy = list(pb.occupancy)  # after construction, which zeroes it
    return stats


def load_to_pb(load: Load) -> target_pb2.Load:
    return target_pb2.Load(max_slots=load.max_slots, free_slots=load.free_slots, running=load.running,
                           queued=load.queued, draft_sequences=load.draft_sequences,
                           draft_connected=load.draft_connected, batch=batch_stats_to_pb(load.batch),
                           draft_model=load.draft_model)


def load_from_pb(pb: target_pb2.Load) -> Load:
    return Load(max_slots=pb.max_slots, free_slots=pb.free_slots, running=pb.running, queued=pb.queued,
                draft_sequences=pb.draft_sequences, draft_connected=pb.draft_connected,
                batch=batch_stats_from_pb(pb.batch), draft_model=pb.draft_model)


def message_to_pb(message: EngineMessage) -> target_pb2.TargetMessage:
    pb = target_pb2.TargetMessage(load=load_to_pb(message.load))
    if message.events:
        pb.events.CopyFrom(target_pb2.Events(step=message.step, events=[event_to_pb(e) for e in message.events]))
    return pb


def info_to_pb(info: TargetInfo) -> target_pb2.TargetInfo:
    pb = target_pb2.TargetInfo(
        model_name=info.model_name, draft_model_name=info.draft_model_name, vocab_size=info.vocab_size,
        max_context_length=info.max_context_length, max_gamma=info.max_gamma, default_gamma=info.default_gamma,
        eos_token_ids=info.eos_token_ids)
    if info.load is not None:
        pb.load.CopyFrom(load_to_pb(info.load))
    return pb


def info_from_pb(pb: target_pb2.TargetInfo) -> TargetInfo:
    return TargetInfo(
        model_name=pb.model_name, vocab_size=pb.vocab_size, max_context_length=pb.max_context_length,
        max_gamma=pb.max_gamma, default_gamma=pb.default_gamma, eos_token_ids=list(pb.eos_token_ids),
        draft_model_name=pb.draft_model_name, load=load_from_pb(pb.load) if pb.HasField("load") else None)
