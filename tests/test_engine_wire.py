"""The engine's messages on the wire (specstream/data/engine_wire.py), both ways, without services.

Every message the `Target.Connect` stream and `GetInfo` carry comes back equal after
`to_pb`, bytes and `from_pb` (values chosen exact in float32 where the wire holds float32); an error
comes back as the class its status code belongs to, with its text; what has no presence on the wire
(`queue_seconds`), unknown enum values and an error event without an error read as documented.
"""

from __future__ import annotations

import math

import grpc
import pytest

from specstream.data.batch_stats import BatchStats
from specstream.data.beam import BeamOptions
from specstream.data.engine import (
    BeamHypothesis,
    EngineMessage,
    Load,
    SequenceEvent,
    SequenceRequest,
    SequenceStats,
    Speculation,
    TargetInfo,
    TokenLogprob,
)
from specstream.data.engine_wire import (
    event_from_pb,
    event_to_pb,
    info_from_pb,
    info_to_pb,
    load_from_pb,
    load_to_pb,
    message_to_pb,
    request_from_pb,
    request_to_pb,
    speculation_from_pb,
)
from specstream.data.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    OverloadedError,
    PermissionDeniedError,
    RemoteError,
    SpecstreamError,
    UnauthenticatedError,
    UnavailableError,
    error_class,
    from_status,
)
from specstream.data.sampling import SamplingParams
from specstream_pb import common_pb2, target_pb2


def _through_bytes(pb):
    return type(pb).FromString(pb.SerializeToString())


def _batch() -> BatchStats:
    stats = BatchStats("topup", 4)
    stats.record_step(rows=3, width=5, tokens=12, waiting=2)
    stats.record_step(rows=4, width=2, tokens=8, waiting=0)
    stats.record_admission(0.25)
    stats.prefill_tokens = 40
    return stats


LOAD = Load(max_slots=6, free_slots=2, running=4, queued=3, draft_sequences=5, draft_connected=True, batch=_batch(),
            draft_model="d")
STATS = SequenceStats(draft_tokens=12, accepted_tokens=7, target_passes=6, mean_accepted_length=2.0, rejections=3,
                      gamma_histogram=[1, 0, 1, 0, 3], alpha_estimate=0.625, beam_expansions=0,
                      accepted_per_position=[4, 2, 1])

REQUESTS = [
    SequenceRequest(id="r1", prompt_token_ids=[5, 6, 7], max_new_tokens=9),
    SequenceRequest(id="r2", prompt_token_ids=[1], max_new_tokens=3, stop_token_ids=frozenset({1, 42}),
                    eos_token_ids=frozenset({1}), speculation=Speculation("fixed", gamma=3),
                    sampling=SamplingParams(temperature=0.75, top_k=20, top_p=0.875, seed=2**64 - 1), logprobs=2,
                    traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),
    SequenceRequest(id="r3", prompt_token_ids=[9, 9], max_new_tokens=1, speculation=Speculation("auto", max_gamma=4),
                    logprobs=0),
    SequenceRequest(id="r4", prompt_token_ids=[2], max_new_tokens=8, speculation=Speculation("off"),
                    beam=BeamOptions(num_beams=4, num_return_sequences=2, length_penalty=0.0, early_stopping="never",
                                     beam_threshold=2.5, max_candidates_per_parent=3)),
    SequenceRequest(id="r5", prompt_token_ids=[2], max_new_tokens=8, beam=BeamOptions(num_beams=2)),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=[r.id for r in REQUESTS])
def test_every_request_crosses_the_wire_unchanged(request_: SequenceRequest) -> None:
    assert request_from_pb(_through_bytes(request_to_pb(request_))) == request_


def test_a_request_on_the_wire_reads_as_the_target_expects() -> None:
    pb = request_to_pb(REQUESTS[1])
    assert list(pb.stop_token_ids) == [1, 42] and list(pb.eos_token_ids) == [1]  # sorted: a stable wire form
    assert pb.logprobs and pb.top_logprobs == 2
    assert pb.speculation == common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_FIXED, gamma=3)
    assert not pb.HasField("beam")
    unset = request_to_pb(REQUESTS[0])
    assert not unset.logprobs and unset.top_logprobs == 0
    fixed_width = request_to_pb(REQUESTS[4]).beam
    assert not fixed_width.HasField("beam_threshold")  # infinity: left unset
    assert fixed_width.HasField("length_penalty") and fixed_width.length_penalty == 1.0
    assert request_from_pb(request_to_pb(REQUESTS[4])).beam.beam_threshold == math.inf


def test_a_bad_speculation_mode_is_invalid_argument_naming_it() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        speculation_from_pb(common_pb2.Speculation(mode=7))
    assert info.value.field == "speculation.mode"
    with pytest.raises(InvalidArgumentError) as info:
        request_from_pb(target_pb2.SequenceRequest(id="x", max_new_tokens=1,
                                                   sampling=common_pb2.Sampling(temperature=1.0, top_p=2.0)))
    assert info.value.field == "sampling.top_p"


EVENTS = [
    SequenceEvent("s1", queue_seconds=0.5, stats=SequenceStats(target_passes=1)),
    SequenceEvent("s1", token_ids=[40, 41], logprobs=[TokenLogprob(40, -0.5, [(40, -0.5), (3, -1.25)]),
                                                      TokenLogprob(41, -2.0, [(41, -2.0)])], stats=STATS),
    SequenceEvent("s1", token_ids=[7], finish_reason="stop", stats=STATS),
    SequenceEvent("s2", token_ids=[40, 41, 1], finish_reason="eos", stats=SequenceStats(beam_expansions=17),
                  sequences=[BeamHypothesis([40, 41, 1], score=-0.25, logprob=-0.75, finish_reason="eos"),
                             BeamHypothesis([40, 42], score=-0.5, logprob=-1.0, finish_reason="length"),
                             BeamHypothesis([45, 7], score=-1.5, logprob=-3.0, finish_reason="stop")]),
    SequenceEvent("s3", finish_reason="cancelled"),
    SequenceEvent("s4", finish_reason="length", token_ids=[8]),
]


@pytest.mark.parametrize("event", EVENTS, ids=[f"{e.id}-{e.finish_reason}" for e in EVENTS])
def test_every_event_crosses_the_wire_unchanged(event: SequenceEvent) -> None:
    assert event_from_pb(_through_bytes(event_to_pb(event))) == event


ERRORS = [InvalidArgumentError("sampling.top_p", 2.0, "must be in (0, 1]"),
          AlreadyExistsError("id", "s1", "already running on this connection"),
          InternalError("the step failed"), OverloadedError("no room"), UnavailableError("shutting down"),
          UnauthenticatedError("no token"), PermissionDeniedError("wrong token")]


@pytest.mark.parametrize("error", ERRORS, ids=[type(e).__name__ for e in ERRORS])
def test_an_error_comes_back_as_the_class_its_status_belongs_to(error: SpecstreamError) -> None:
    event = event_from_pb(_through_bytes(event_to_pb(SequenceEvent("s1", finish_reason="error", error=error))))
    assert event.finish_reason == "error"
    assert type(event.error) is type(error) and event.error.code == error.code and str(event.error) == str(error)
    assert error_class(error.code) is type(error)


def test_a_rebuilt_invalid_argument_error_names_no_field_but_keeps_the_text() -> None:
    error = from_status(grpc.StatusCode.INVALID_ARGUMENT, "beam.num_beams=9: more than the target's 8 slots")
    assert isinstance(error, InvalidArgumentError) and isinstance(error, ValueError)
    assert error.field is None and error.value is None and error.reason == str(error)
    assert str(error) == "beam.num_beams=9: more than the target's 8 slots"


def test_a_status_no_class_has_comes_back_as_a_remote_error_with_its_code() -> None:
    pb = common_pb2.SequenceError(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="too slow")
    event = event_from_pb(target_pb2.SequenceEvent(id="s1", finish_reason=common_pb2.FINISH_REASON_ERROR, error=pb))
    assert type(event.error) is RemoteError and event.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(event.error) == "too slow" and error_class(grpc.StatusCode.DEADLINE_EXCEEDED) is RemoteError


def test_an_error_event_without_an_error_and_an_unknown_finish_reason_both_end_in_error() -> None:
    bare = event_from_pb(target_pb2.SequenceEvent(id="s1", finish_reason=common_pb2.FINISH_REASON_ERROR))
    assert bare.finish_reason == "error" and isinstance(bare.error, InternalError) and "no error" in str(bare.error)
    newer = event_from_pb(target_pb2.SequenceEvent(id="s1", token_ids=[3], finish_reason=99))
    assert newer.finish_reason == "error" and isinstance(newer.error, InternalError) and newer.token_ids == [3]


def test_a_running_sequences_event_has_no_finish_reason_and_zero_queue_time_reads_as_none() -> None:
    event = event_from_pb(target_pb2.SequenceEvent(id="s1", token_ids=[4], queue_seconds=0.0))
    assert event.finish_reason is None and event.error is None and event.queue_seconds is None


def test_a_load_crosses_the_wire_with_every_batch_counter() -> None:
    back = load_from_pb(_through_bytes(load_to_pb(LOAD)))
    assert back == LOAD
    assert back.batch.occupancy == [0, 0, 0, 1, 1] and back.batch.padded_tokens == 3 * 5 - 12 + 4 * 2 - 8


def test_the_targets_info_crosses_the_wire_with_or_without_its_load() -> None:
    info = TargetInfo(model_name="m", vocab_size=300, max_context_length=512, max_gamma=8, default_gamma=4,
                      eos_token_ids=[2, 3], draft_model_name="d", load=LOAD)
    assert info_from_pb(_through_bytes(info_to_pb(info))) == info
    bare = TargetInfo(model_name="m", vocab_size=300, max_context_length=512, max_gamma=8)
    assert not info_to_pb(bare).HasField("load") and info_from_pb(info_to_pb(bare)) == bare


def test_an_engine_message_carries_its_step_events_and_load() -> None:
    pb = _through_bytes(message_to_pb(EngineMessage(LOAD, step=7, events=EVENTS)))
    assert pb.events.step == 7 and [event_from_pb(e) for e in pb.events.events] == EVENTS
    assert load_from_pb(pb.load) == LOAD
    assert not message_to_pb(EngineMessage(LOAD)).HasField("events")  # load only
