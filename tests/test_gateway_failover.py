"""A target replica lost mid-request, without processes: real `Router`, `TargetClient`s and
request pipeline, the targets played by feeding the clients scripted messages.

Checks the continuation a started request is resubmitted as (prompt + tokens received, the rest
of the budget, every other option unchanged; a beam request restarts), stats summed over the
attempts, a caller's stream that crosses a move (text, a stop string split across the replicas,
usage), and the step-progress watchdog: its deadline from measured step times, a silent replica
with work declared hung (requests moved, stream torn down), an idle or progressing one never."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_gateway_router import (
    LIMITS,
    TT,
    Clock,
    error_code,
    finished,
    replica,
    report,
    run_async,
    submit,
    token,
    written,
)

from gateway.request import stream_chunks
from gateway.resume import continuation, merge_stats
from gateway.router import Router
from gateway.ticket import Ticket
from gateway.validation import validate
from gateway.watchdog import StepWatchdog
from specstream.data.beam import BeamOptions
from specstream.data.config import StallConfig
from specstream.data.engine import SequenceEvent, SequenceRequest, SequenceStats, Speculation
from specstream.data.errors import InvalidArgumentError, UnavailableError
from specstream.data.sampling import SamplingParams
from specstream.serving.metrics import GatewayMetrics
from specstream_pb import common_pb2, generation_pb2, target_pb2


def _full_request() -> SequenceRequest:
    """Every option a caller can set, so a dropped one shows."""
    return SequenceRequest(
        id="caller-7", prompt_token_ids=[11, 12, 13], max_new_tokens=10, stop_token_ids=frozenset({1, 42}),
        eos_token_ids=frozenset({1}), speculation=Speculation("fixed", gamma=3),
        sampling=SamplingParams(temperature=0.75, top_k=20, top_p=0.875, seed=12345),
        logprobs=2, traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")


def test_the_continuation_appends_the_tokens_received_and_keeps_every_other_option():
    original = _full_request()
    resumed = continuation(original, [21, 22, 23, 24])
    assert list(resumed.prompt_token_ids) == [11, 12, 13, 21, 22, 23, 24]
    assert resumed.max_new_tokens == 6
    # The first new token sits at absolute position 3 + 4 = 7 either way, which is what seeded
    # sampling keys its randomness by.
    assert len(resumed.prompt_token_ids) == len(original.prompt_token_ids) + 4
    for name in ("id", "stop_token_ids", "eos_token_ids", "speculation", "sampling", "logprobs", "traceparent",
                 "beam"):
        assert getattr(resumed, name) == getattr(original, name), name
    assert list(original.prompt_token_ids) == [11, 12, 13] and original.max_new_tokens == 10  # untouched
    beam = SequenceRequest(id="b", prompt_token_ids=[5], max_new_tokens=8, beam=BeamOptions(num_beams=3))
    assert continuation(beam, []) == beam  # a beam sends its tokens only at the end: it starts over


def test_stats_add_over_attempts_and_tokens_per_pass_is_reweighted():
    lost = SequenceStats(draft_tokens=12, accepted_tokens=8, target_passes=5, mean_accepted_length=3.0,
                         rejections=2, gamma_histogram=[0, 0, 0, 4], alpha_estimate=0.5, beam_expansions=0,
                         accepted_per_position=[4, 3, 1])
    now = SequenceStats(draft_tokens=4, accepted_tokens=1, target_passes=3, mean_accepted_length=1.0,
                        rejections=2, gamma_histogram=[0, 0, 2], alpha_estimate=0.25, accepted_per_position=[1])
    merged = merge_stats(lost, now)
    assert (merged.draft_tokens, merged.accepted_tokens, merged.target_passes, merged.rejections) == (16, 9, 8, 4)
    assert merged.gamma_histogram == [0, 0, 2, 4] and merged.accepted_per_position == [5, 3, 1]
    assert merged.mean_accepted_length == pytest.approx((3.0 * 4 + 1.0 * 2) / 6)  # 14 tokens over 6 passes
    assert merged.alpha_estimate == 0.25
    assert merge_stats(SequenceStats(), now) == now
    assert lost.gamma_histogram == [0, 0, 0, 4] and now.gamma_histogram == [0, 0, 2]  # neither changed
    beams = merge_stats(SequenceStats(target_passes=2, beam_expansions=7), SequenceStats(target_passes=1,
                                                                                       beam_expansions=4))
    assert (beams.beam_expansions, beams.target_passes, beams.mean_accepted_length) == (11, 3, 0.0)


@run_async
async def test_a_resumed_request_goes_out_with_every_option_and_its_stats_count_both_replicas():
    a, b = replica("a", max_slots=2), replica("b", max_slots=2)
    router = Router([a, b], max_queue=10)
    ticket = router.submit(_full_request())
    first = ticket.replica
    other = b if first is a else a
    step = common_pb2.SpeculationStats(target_passes=2, gamma_histogram=[0, 0, 0, 1], mean_accepted_length=3.0)
    report(first, running=1, queued=0,
           events=[target_pb2.SequenceEvent(id=ticket.request.id, token_ids=[21, 22, 23, 24], stats=step)])
    written(first)
    first._lose("target gone")
    (sent,) = [r for r in _submitted(other)]
    assert list(sent.prompt_token_ids) == [11, 12, 13, 21, 22, 23, 24] and sent.max_new_tokens == 6
    assert (sent.sampling.seed, sent.sampling.temperature, sent.sampling.top_k, sent.sampling.top_p) == \
        (12345, 0.75, 20, 0.875)
    assert sent.logprobs and sent.top_logprobs == 2 and sent.traceparent == ticket.original.traceparent
    assert list(sent.stop_token_ids) == [1, 42] and list(sent.eos_token_ids) == [1]
    assert sent.speculation == common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_FIXED, gamma=3)
    assert sent.id != ticket.original.id and not sent.HasField("beam")
    last = common_pb2.SpeculationStats(target_passes=1, gamma_histogram=[1], mean_accepted_length=1.0)
    report(other, running=0, queued=0, events=[target_pb2.SequenceEvent(
        id=sent.id, token_ids=[25], stats=last, finish_reason=common_pb2.FINISH_REASON_LENGTH)])
    events = list(ticket.events._queue)
    assert [t for e in events for t in e.token_ids] == [21, 22, 23, 24, 25]
    assert events[-1].stats.target_passes == 3 and events[-1].stats.gamma_histogram == [1, 0, 0, 1]
    assert events[-1].stats.mean_accepted_length == pytest.approx((3.0 + 1.0) / 2)  # one decode pass each
    assert ticket.done and ticket.resumes == 1 and first.resumed == 1


def _submitted(client) -> list[target_pb2.SequenceRequest]:
    requests = []
    while not client._outgoing.empty():
        requests += list(client._outgoing.get_nowait().submit.requests)
    return requests


def _chunk_events(ticket_id: str, ids: list[int], finish: bool) -> list[target_pb2.SequenceEvent]:
    events = [target_pb2.SequenceEvent(id=ticket_id, token_ids=[t]) for t in ids]
    if finish:
        events[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
    return events


@pytest.mark.parametrize("before_stop_end", [8, 4, 2, 1])  # tokens before the one completing "STOP"
@run_async
async def test_the_callers_stream_crosses_a_move_without_a_seam(before_stop_end):
    """The text is detokenized and stop-string matched across the move as in one run, wherever
    the replica is lost (inside the stop string too); usage counts the original prompt and
    every token."""
    text = "ab cd STOP ef gh"
    ids = TT.encode(text)[1:]
    stop_end = next(k for k in range(1, len(ids) + 1) if "STOP" in TT.decode(ids[:k]))
    split = stop_end - before_stop_end  # a sends ids[:split], b the rest
    a, b = replica("a", max_slots=1), replica("b", max_slots=1)
    router = Router([a, b], max_queue=10)
    request = validate(generation_pb2.GenerateRequest(prompt="# x", max_new_tokens=len(ids), stop=["STOP"]), LIMITS, TT)
    metrics = GatewayMetrics()
    stream = stream_chunks(request, router, TT, metrics)
    chunks = []
    reader = asyncio.ensure_future(_collect(stream, chunks))
    await asyncio.sleep(0)
    (ticket_id,) = written(a)[0] or written(b)[0]
    first = a if a.outstanding else b
    other = b if first is a else a
    report(first, running=1, queued=0, events=_chunk_events(ticket_id, ids[:split], finish=False))
    await asyncio.sleep(0)
    first._lose(f"target {first.url} connection lost")
    (resumed,) = _submitted(other)
    assert list(resumed.prompt_token_ids) == request.prompt_ids + ids[:split]
    report(other, running=1, queued=0, events=_chunk_events(resumed.id, ids[split:], finish=True))
    await asyncio.wait_for(reader, 5)
    got_ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == "ab cd "
    assert got_ids == ids[:stop_end]  # up to the token that completed the stop string, none twice
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(request.prompt_ids), stop_end)
    assert metrics.registry.get_sample_value("specstream:requests_resumed_total") == 1


async def _collect(stream, chunks) -> None:
    async for chunk in stream:
        chunks.append(chunk)


@run_async
async def test_a_started_request_with_no_replica_left_fails_unavailable_to_the_caller():
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10)
    request = validate(generation_pb2.GenerateRequest(prompt="# x", max_new_tokens=8), LIMITS, TT)
    stream = stream_chunks(request, router, TT, GatewayMetrics())
    reader = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    (ticket_id,) = written(a)[0]
    report(a, running=1, queued=0, events=[target_pb2.SequenceEvent(id=ticket_id, token_ids=[70, 71])])
    first_chunk = await asyncio.wait_for(reader, 5)
    assert list(first_chunk.token_ids) == [70, 71]
    a._lose("target a:1 connection lost (UNAVAILABLE: kill -9)")
    with pytest.raises(UnavailableError) as info:
        await asyncio.wait_for(anext(stream), 5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no target replica is serving (target a:1 connection lost" in str(info.value)


# ----- the watchdog ---------------------------------------------------------------------------------

FAST = StallConfig(floor_s=1.0, ceiling_s=2.0)  # tight bounds, so that the tests' clocks stay short

def test_the_deadline_follows_the_measured_steps_between_floor_and_ceiling():
    dog = StepWatchdog(StallConfig(floor_s=1.0, ceiling_s=2.0, step_multiple=20.0))
    assert dog.deadline() == 2.0  # nothing measured yet: the ceiling
    now = 0.0
    dog.work_started(now)
    for gap in [0.01] * 99 + [0.07]:  # 100 silences: p99 is the 99th smallest, 0.01
        now += gap
        dog.heard(now)
    assert dog.deadline() == 1.0  # 20 x 0.01 = 0.2, raised to the floor
    for _ in range(5):  # a few slow steps: more than 1% of the window
        now += 0.08
        dog.heard(now)
    assert dog.deadline() == pytest.approx(1.6)  # 20 x 0.08
    for _ in range(10):
        now += 0.5
        dog.heard(now)
    assert dog.deadline() == 2.0  # 20 x 0.5 = 10, capped at the ceiling
    assert not dog.stalled(now + 1.9) and dog.stalled(now + 2.1)
    dog.work_ended()
    assert not dog.stalled(now + 60) and dog.silence(now + 60) == 0.0


def test_silence_counts_from_when_work_arrived_not_from_an_idle_replicas_last_message():
    dog = StepWatchdog(StallConfig(floor_s=1.0, ceiling_s=2.0))
    dog.heard(0.0)  # idle replica's last Load
    dog.work_started(100.0)
    assert dog.silence(100.5) == 0.5 and not dog.stalled(101.5)
    assert dog.stalled(102.5)


@run_async
async def test_a_silent_replica_with_work_is_declared_hung_and_its_requests_move():
    clock = Clock()
    a, b = replica("a", max_slots=1, clock=clock, stall=FAST), replica("b", max_slots=1, clock=clock, stall=FAST)
    router = Router([a, b], max_queue=10, clock=clock)
    tickets = submit(router, 3)  # a: 1 (running) and 3 (in its queue); b: 2
    for i in range(20):  # a steps every 50 ms while it has work: 20 x 50 ms = the floor, 1 s
        clock.now += 0.05
        report(a, running=1, queued=1, events=[token(tickets[0], 9)] if i < 2 else [])
    assert a.watchdog.deadline() == pytest.approx(1.0)
    call = a._call
    clock.now += 0.9
    assert not a.check_progress(clock.now) and a.routable  # 0.9 s of silence: within the deadline
    clock.now += 0.2
    assert a.check_progress(clock.now)  # 1.1 s: hung
    assert call.cancelled and a._call is None and not a.routable and a.stalls == 1
    assert a.outstanding == 0 and (a.resumed, a.requeued) == (1, 1)
    # 1 continues on b after its 2 tokens (first in line, ahead of 3, which goes as it was).
    assert list(tickets[0].request.prompt_token_ids) == [1, 9, 9] and tickets[0].request.max_new_tokens == 2
    assert list(tickets[2].request.prompt_token_ids) == [3] and tickets[2].replica is None
    assert router.serving and error_code(tickets[0]) is None
    report(b, running=0, queued=0, events=[finished(tickets[1])])
    assert tickets[0].replica is b


@run_async
async def test_no_replica_left_after_a_stall_fails_the_started_request_and_refuses_new_ones():
    clock = Clock()
    a = replica("a", max_slots=1, clock=clock, stall=FAST)
    router = Router([a], max_queue=10, backlog=0, clock=clock)
    running, queued = submit(router, 2)
    report(a, running=1, queued=0, events=[token(running, 4)])
    clock.now += 2.5  # nothing measured but the first reply: the ceiling (2 s) applies
    assert a.check_progress(clock.now)
    assert error_code(running) == grpc.StatusCode.UNAVAILABLE and error_code(queued) == grpc.StatusCode.UNAVAILABLE
    assert "hung" in str(list(running.events._queue)[-1].error)
    assert not router.serving


@run_async
async def test_an_idle_replica_or_one_that_keeps_stepping_is_never_declared_hung():
    clock = Clock()
    a = replica("a", max_slots=4, clock=clock)
    router = Router([a], max_queue=10, clock=clock)
    clock.now += 100.0
    assert not a.check_progress(clock.now)  # nothing outstanding: silence is expected
    (ticket,) = submit(router, 1)
    for _ in range(300):  # 30 s of steady 0.1 s steps
        clock.now += 0.1
        report(a, running=1, queued=0, events=[token(ticket, 3)])
        assert not a.check_progress(clock.now)
    report(a, running=0, queued=0, events=[finished(ticket)])
    clock.now += 100.0
    assert not a.check_progress(clock.now) and a.stalls == 0 and a.routable


def test_stall_settings_are_validated():
    with pytest.raises(ValueError, match="ceiling_s=0.5"):
        StallConfig(floor_s=1.0, ceiling_s=0.5)
    with pytest.raises(ValueError, match="floor_s=0"):
        StallConfig(floor_s=0)


def test_a_ticket_never_resumes_once_done():
    ticket = Ticket(SequenceRequest(id="1", prompt_token_ids=[1], max_new_tokens=2), number=0, enqueued_at=0.0)
    ticket.deliver(SequenceEvent(id="1", token_ids=[5, 6], finish_reason="length"))
    with pytest.raises(AssertionError):
        ticket.resume("late")


@run_async
async def test_a_request_the_target_ends_with_unavailable_moves_but_other_errors_reach_the_caller():
    """UNAVAILABLE on an event is the target going away (its grace period ran out), not the
    request's fault; any other error is the caller's answer."""
    a, b = replica("a", max_slots=2), replica("b", max_slots=2)
    router = Router([a, b], max_queue=10)
    going, bad = submit(router, 2)  # one on each replica
    report(going.replica, running=1, queued=0, events=[token(going, 6)])
    shutting = going.replica
    await shutting._set_serving(False)  # SIGTERM: NOT_SERVING, the started request runs on in the grace period
    assert going.replica is shutting
    report(shutting, running=0, queued=0, events=[target_pb2.SequenceEvent(
        id=going.request.id, finish_reason=common_pb2.FINISH_REASON_ERROR,
        error=common_pb2.SequenceError(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                       message="the target service is shutting down"))])
    assert error_code(going) is None and going.replica is bad.replica and shutting.resumed == 1
    assert list(going.request.prompt_token_ids) == [1, 6]
    report(bad.replica, running=1, queued=0, events=[target_pb2.SequenceEvent(
        id=bad.request.id, finish_reason=common_pb2.FINISH_REASON_ERROR,
        error=common_pb2.SequenceError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad"))])
    assert error_code(bad) == grpc.StatusCode.INVALID_ARGUMENT
    error = list(bad.events._queue)[-1].error  # rebuilt as the class the target's code belongs to
    assert isinstance(error, InvalidArgumentError) and str(error) == "bad" and error.field is None


def test_a_request_lost_after_its_last_token_but_before_its_final_event_finishes_here():
    ticket = Ticket(SequenceRequest(id="1", prompt_token_ids=[1], max_new_tokens=3), number=0, enqueued_at=0.0)
    ticket.deliver(SequenceEvent(id="1", token_ids=[5, 6, 7], stats=SequenceStats(target_passes=2)))
    assert not ticket.resume("lost") and ticket.done and ticket.resumes == 0
    last = list(ticket.events._queue)[-1]
    assert last.finish_reason == "length" and last.stats.target_passes == 2
