"""The gateway's queue and routing without processes: real `Router` and `TargetClient` objects, the
clients' streams never opened; each test plays the targets' side by feeding the clients the
messages a target would send (Load reports, events) and reading what the clients would write.

Checks the capacity rule (slots + backlog, the Load term, sends since the last Load), refusal of a
full queue, FIFO order, cancelling a queued request, least-loaded choice, and what happens to
started and unstarted requests when a replica's stream breaks, its watchdog declares it hung, or
it stops serving: started ones continue elsewhere from the tokens already received."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from gateway.request import stream_chunks
from gateway.router import Router
from gateway.target_client import TargetClient
from gateway.ticket import Ticket
from gateway.validation import Limits, validate
from specstream.data.batch_stats import BatchStats
from specstream.data.config import GatewayConfig, StallConfig
from specstream.data.engine import Load, SequenceRequest, TargetInfo
from specstream.data.errors import OverloadedError, UnavailableError
from specstream.serving.metrics import GatewayMetrics
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_pb import common_pb2, generation_pb2, target_pb2


def run_async(test):
    """Runs an `async def` test on a fresh event loop (grpc.aio channels need a running loop)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCall:
    """Stands in for the Connect call: records that it was torn down."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def replica(name: str, max_slots: int, clock: Clock | None = None, stall: StallConfig | None = None) -> TargetClient:
    """A client whose stream is up and whose target reports SERVING and an empty engine."""
    client = TargetClient(f"{name}:1", stall=stall, **({"clock": clock} if clock else {}))
    client.connected = client.serving = True
    client.load = Load(max_slots=max_slots, free_slots=max_slots, running=0, queued=0, draft_sequences=0,
                       draft_connected=False, batch=BatchStats("static", max_slots))
    client._call = FakeCall()
    return client


def written(client: TargetClient) -> tuple[list[str], list[str]]:
    """Takes what the client queued for its stream: (submitted stream ids, cancelled stream ids)."""
    submitted, cancelled = [], []
    while not client._outgoing.empty():
        message = client._outgoing.get_nowait()
        submitted += [r.id for r in message.submit.requests]
        cancelled += list(message.cancel.ids)
    return submitted, cancelled


def report(client: TargetClient, running: int, queued: int, events: list[target_pb2.SequenceEvent] = ()) -> None:
    """The target's per-step message, as it arrives on the wire: events plus its Load."""
    load = target_pb2.Load(max_slots=client.load.max_slots, free_slots=client.load.max_slots - running,
                           running=running, queued=queued)
    client._on_message(target_pb2.TargetMessage(events=target_pb2.Events(events=list(events)), load=load))


def token(ticket: Ticket, *ids: int) -> target_pb2.SequenceEvent:
    return target_pb2.SequenceEvent(id=ticket.request.id, token_ids=list(ids))


def finished(ticket: Ticket) -> target_pb2.SequenceEvent:
    return target_pb2.SequenceEvent(id=ticket.request.id, token_ids=[5], finish_reason=common_pb2.FINISH_REASON_LENGTH)


def submit(router: Router, n: int, prompt: int = 1) -> list[Ticket]:
    return [router.submit(SequenceRequest(id=f"caller-{prompt + i}", prompt_token_ids=[prompt + i], max_new_tokens=4))
            for i in range(n)]


def prompts(tickets) -> list[int]:
    return [t.request.prompt_token_ids[0] for t in tickets]


def error_code(ticket: Ticket) -> grpc.StatusCode | None:
    """The status of the ticket's error event, if its last queued event is one."""
    events = list(ticket.events._queue)
    if events and events[-1].finish_reason == "error":
        return events[-1].error.code
    return None


@run_async
async def test_a_replica_takes_its_slots_plus_the_backlog_then_the_queue_fills_and_refuses_at_once():
    a = replica("a", max_slots=2)
    router = Router([a], max_queue=3)
    tickets = submit(router, 7)
    assert [t.replica for t in tickets] == [a] * 4 + [None] * 3  # 2 slots + backlog of 2 (= max_slots)
    assert len(written(a)[0]) == 4 and router.queued == 3
    with pytest.raises(OverloadedError, match=r"max_queue=3") as info:
        submit(router, 1)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert router.queued == 3


@run_async
async def test_backlog_is_configurable_and_zero_queue_refuses_what_no_replica_can_take():
    a = replica("a", max_slots=2)
    router = Router([a], max_queue=0, backlog=0)
    assert [t.replica for t in submit(router, 2)] == [a, a]
    with pytest.raises(OverloadedError, match="max_queue=0"):
        submit(router, 1)


@run_async
async def test_load_from_other_gateways_and_sends_since_the_last_load_both_count():
    a = replica("a", max_slots=2)
    router = Router([a], max_queue=10)
    report(a, running=2, queued=1)  # another gateway's three sequences: room for one more of ours
    first, second = submit(router, 2)
    assert first.replica is a and second.replica is None  # 3 + 1 sent since that Load = 4 = capacity
    report(a, running=2, queued=2)  # the next Load counts ours
    assert a.sent_since_load == 0 and second.replica is None
    report(a, running=2, queued=1)  # one of the other gateway's sequences finished
    assert second.replica is a


@run_async
async def test_a_load_that_does_not_count_our_submit_yet_cannot_oversubscribe():
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10, backlog=0)
    first, second = submit(router, 2)
    # Computed before the target read our Submit: it shows an idle engine. Our own outstanding
    # request still counts, so nothing more is sent.
    report(a, running=0, queued=0)
    assert a.sent_since_load == 0 and a.outstanding == 1
    assert first.replica is a and second.replica is None


@run_async
async def test_finishing_frees_room_and_the_queue_drains_oldest_first():
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10, backlog=0)
    tickets = submit(router, 4)
    assert prompts(t for t in tickets if t.replica) == [1]
    for i in range(3):
        running = tickets[i]
        report(a, running=0, queued=0, events=[token(running, 7), finished(running)])  # Load after retiring it
        assert tickets[i + 1].replica is a, f"step {i}"
        assert all(t.replica is None for t in tickets[i + 2:])
    assert router.queued == 0


@run_async
async def test_a_cancelled_queued_request_leaves_the_queue():
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10, backlog=0)
    running, gone, kept = submit(router, 3)
    router.cancel(gone)
    assert router.queued == 1
    report(a, running=0, queued=0, events=[finished(running)])
    assert kept.replica is a and gone.replica is None
    assert written(a)[0] == [running.request.id, kept.request.id]
    router.cancel(kept)  # cancelling a sent request cancels it on the target
    assert written(a)[1] == [kept.request.id]
    assert a.outstanding == 0


@run_async
async def test_least_loaded_replica_wins_and_ties_alternate():
    a, b = replica("a", max_slots=4), replica("b", max_slots=4)
    router = Router([a, b], max_queue=10)
    for ticket in submit(router, 4):  # one at a time, each done before the next: alternate
        report(ticket.replica, running=1, queued=0, events=[finished(ticket)])
        report(ticket.replica, running=0, queued=0)
    assert (a.routed, b.routed) == (2, 2)
    report(a, running=4, queued=0)  # someone else's load on a: half its capacity of 8
    assert [t.replica for t in submit(router, 4)] == [b, b, b, b]
    assert (a.routed, b.routed) == (2, 6)
    assert {t.replica.url for t in submit(router, 2)} == {"a:1", "b:1"}  # now equally full: both get one


@run_async
async def test_replicas_with_different_slots_fill_in_proportion():
    a, b = replica("a", max_slots=1), replica("b", max_slots=3)
    router = Router([a, b], max_queue=10)
    submit(router, 8)
    assert (a.outstanding, b.outstanding) == (2, 6) and router.queued == 0


@run_async
async def test_a_lost_stream_resumes_started_requests_and_moves_unstarted_ones_first_in_line():
    clock = Clock()
    a, b = replica("a", max_slots=1), replica("b", max_slots=1)
    router = Router([a, b], max_queue=10, clock=clock)
    tickets = submit(router, 6)
    assert prompts(t for t in tickets if t.replica is a) == [1, 3]  # 3 waits in a's own queue
    assert prompts(t for t in tickets if t.replica is b) == [2, 4]
    report(a, running=1, queued=1, events=[token(tickets[0], 9, 8)])  # 1 has started on a
    clock.now = 2.0
    a._lose("target a:1 connection lost (UNAVAILABLE: kill -9)")
    assert error_code(tickets[0]) is None and not tickets[0].done  # started: it will continue ...
    # ... as its continuation: the prompt plus what the caller already has, the rest of the budget.
    assert list(tickets[0].request.prompt_token_ids) == [1, 9, 8] and tickets[0].request.max_new_tokens == 2
    assert tickets[2].replica is None and not tickets[2].done  # unstarted: back in the gateway's queue ...
    assert list(tickets[2].request.prompt_token_ids) == [3]  # ... as it was
    assert router.queued == 4 and a.requeued == 1 and a.resumed == 1
    report(b, running=1, queued=0, events=[finished(tickets[1])])  # 4 got b's slot
    assert tickets[0].replica is b  # oldest first, ahead of the requests that arrived after it
    report(b, running=1, queued=0, events=[token(tickets[0], 7), finished(tickets[3])])
    assert tickets[2].replica is b
    assert tickets[4].replica is None and tickets[5].replica is None
    assert tickets[2].gateway_queue_seconds == 2.0  # its time on a counts as waiting
    assert a.outstanding == 0 and not a.routable
    # The reader sees one sequence: a's tokens, then b's, nothing repeated, nothing lost.
    assert [list(e.token_ids) for e in tickets[0].events._queue] == [[9, 8], [7]]
    assert tickets[0].generated == [9, 8, 7]
    assert list(tickets[2].events._queue) == []  # nothing reached its reader: the move is invisible


@run_async
async def test_losing_the_last_replica_fails_the_queue_and_refuses_new_requests():
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10, backlog=0)
    running, queued = submit(router, 2)
    report(a, running=1, queued=0, events=[token(running, 5)])
    a._lose("target a:1 connection lost")
    assert error_code(queued) == grpc.StatusCode.UNAVAILABLE  # nowhere left to go: no hang
    assert error_code(running) == grpc.StatusCode.UNAVAILABLE  # started, but no replica to resume it on
    assert "target a:1 connection lost" in str(list(running.events._queue)[-1].error)
    assert router.queued == 0
    with pytest.raises(UnavailableError, match="no target replica is serving"):
        submit(router, 1)


@run_async
async def test_a_replica_that_stops_serving_hands_back_its_unstarted_requests_at_once():
    a, b = replica("a", max_slots=1), replica("b", max_slots=1)
    router = Router([a, b], max_queue=10)
    tickets = submit(router, 5)
    written(a)
    report(a, running=1, queued=1, events=[token(tickets[0], 3)])
    await a._set_serving(False)  # SIGTERM on a: NOT_SERVING, then its grace period
    assert written(a)[1] == [tickets[2].request.id]  # the unstarted one is cancelled there ...
    assert tickets[2].replica is None and router.queued == 2  # ... and queued here again, first
    assert tickets[0].replica is a and error_code(tickets[0]) is None  # the started one finishes on a
    report(a, running=1, queued=0, events=[token(tickets[2], 8)])  # a late event for it is dropped
    assert list(tickets[2].events._queue) == []
    report(a, running=0, queued=0, events=[finished(tickets[0])])
    assert router.queued == 2  # a has room but is not serving
    report(b, running=1, queued=0, events=[finished(tickets[1])])
    assert tickets[2].replica is b
    await a._set_serving(True)
    assert tickets[4].replica is a


@run_async
async def test_a_request_that_finished_or_was_cancelled_is_not_moved():
    a, b = replica("a", max_slots=1), replica("b", max_slots=1)
    router = Router([a, b], max_queue=10)
    done, cancelled = submit(router, 2)
    report(a, running=0, queued=0, events=[finished(done)])
    router.cancel(cancelled)
    a._lose("gone")
    b._lose("gone")
    assert router.queued == 0 and a.requeued == 0 and b.requeued == 0 and a.resumed == b.resumed == 0
    assert error_code(done) is None and error_code(cancelled) is None


TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
LIMITS = Limits.build(GatewayConfig("t:1", "m"),
                      TargetInfo(vocab_size=TT.vocab_size, max_context_length=256, max_gamma=8))


@pytest.mark.parametrize("leave", ["cancel", "deadline"])
@run_async
async def test_a_caller_that_leaves_while_queued_leaves_the_queue(leave):
    a = replica("a", max_slots=1)
    router = Router([a], max_queue=10, backlog=0)
    submit(router, 1)  # holds the only place
    request = validate(generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=4), LIMITS, TT)
    first_chunk = anext(stream_chunks(request, router, TT, GatewayMetrics()))
    if leave == "deadline":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first_chunk, timeout=0.05)
    else:
        task = asyncio.ensure_future(first_chunk)
        await asyncio.sleep(0.01)
        assert router.queued == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert router.queued == 0 and a.outstanding == 1
