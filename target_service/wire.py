"""The target service's protobuf edge: ``SequenceRequest`` messages in, ``TargetMessage`` out.

The engine speaks ``specstream/data/engine.py``; only the servicer (and tools that read the wire
format) call these. A request that cannot be converted (e.g. sampling settings out of range) raises
InvalidArgumentError naming the field, prefixed as the request spells it (``sampling.top_p``).
"""

from __future__ import annotations

from specstream.data.beam import BeamOptions
from specstream.data.errors import InvalidArgumentError, SpecstreamError
from specstream.data.sampling import SamplingParams
from specstream_pb import common_pb2, target_pb2
from specstream.data.batch_stats import BatchStats
from specstream.data.engine import EngineMessage, Load, SequenceEvent, SequenceRequest, SequenceStats, Speculation

__all__ = ["batch_stats_to_pb", "load_to_pb", "message_to_pb", "request_from_pb"]

_MODES = {
    common_pb2.SPECULATION_MODE_AUTO: "auto",
    common_pb2.SPECULATION_MODE_OFF: "off",
    common_pb2.SPECULATION_MODE_FIXED: "fixed",
}
_FINISH = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "eos": common_pb2.FINISH_REASON_EOS,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def request_from_pb(pb: target_pb2.SequenceRequest) -> SequenceRequest:
    mode = _MODES.get(pb.speculation.mode)
    if mode is None:
        raise InvalidArgumentError("speculation.mode", pb.speculation.mode, "unknown speculation mode")
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
        speculation=Speculation(mode, pb.speculation.gamma, pb.speculation.max_gamma),
        sampling=sampling,
        logprobs=pb.top_logprobs if pb.logprobs else None,
        traceparent=pb.traceparent,
        beam=BeamOptions.from_pb(pb.beam) if pb.HasField("beam") else None,
    )


def stats_to_pb(stats: SequenceStats) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens, target_passes=stats.target_passes,
        mean_accepted_length=stats.mean_accepted_length, rejections=stats.rejections,
        gamma_histogram=stats.gamma_histogram, alpha_estimate=stats.alpha_estimate,
        beam_expansions=stats.beam_expansions, accepted_per_position=stats.accepted_per_position)


def _error_pb(error: SpecstreamError) -> common_pb2.SequenceError:
    return common_pb2.SequenceError(code=error.code.value[0], message=str(error))


def event_to_pb(event: SequenceEvent) -> target_pb2.SequenceEvent:
    pb = target_pb2.SequenceEvent(
        id=event.id, token_ids=event.token_ids, stats=stats_to_pb(event.stats),
        logprobs=[common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                          top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in lp.top])
                  for lp in event.logprobs],
        sequences=[common_pb2.BeamSequence(token_ids=h.token_ids, score=h.score, logprob=h.logprob,
                                           finish_reason=_FINISH[h.finish_reason]) for h in event.sequences])
    if event.finish_reason is not None:
        pb.finish_reason = _FINISH[event.finish_reason]
    if event.error is not None:
        pb.error.CopyFrom(_error_pb(event.error))
    if event.queue_seconds is not None:
        pb.queue_seconds = event.queue_seconds
    return pb


def batch_stats_to_pb(stats: BatchStats) -> common_pb2.BatchStats:
    return common_pb2.BatchStats(
        policy=stats.policy, max_batch=stats.max_batch, steps=stats.steps, row_expansions=stats.row_expansions,
        tokens_processed=stats.tokens_processed, padded_tokens=stats.padded_tokens,
        prefill_tokens=stats.prefill_tokens, queued_steps=stats.queued_steps, queued_rows=stats.queued_rows,
        admitted=stats.admitted, queue_seconds=stats.queue_seconds, occupancy=stats.occupancy)


def load_to_pb(load: Load) -> target_pb2.Load:
    return target_pb2.Load(max_slots=load.max_slots, free_slots=load.free_slots, running=load.running,
                           queued=load.queued, draft_sequences=load.draft_sequences,
                           draft_connected=load.draft_connected, batch=batch_stats_to_pb(load.batch))


def message_to_pb(message: EngineMessage) -> target_pb2.TargetMessage:
    pb = target_pb2.TargetMessage(load=load_to_pb(message.load))
    if message.events:
        pb.events.CopyFrom(target_pb2.Events(step=message.step, events=[event_to_pb(e) for e in message.events]))
    return pb
