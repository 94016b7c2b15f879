"""A request's place in the gateway from admission to its last event.

The request pipeline reads the ticket's `events`; the router and the replica it is sent to write
them. The queue stays the same when the router moves the request to another replica — before it
started there, or after (its *continuation*, gateway/resume.py, picks up after the tokens already
received) — so a move is invisible to the reader: the events read as one sequence's, with stats
counting every attempt. Knows nothing about routing policy or about gRPC streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from gateway.resume import continuation, merge_stats
from specstream_pb import common_pb2, target_pb2


class Replica(Protocol):
    """Where a ticket was sent (gateway/target_client.py's TargetClient): the router cancels it there."""

    def cancel(self, ticket: Ticket) -> bool:
        """Cancels the ticket's sequence if the replica still holds it; whether it did."""


@dataclass(eq=False)
class Ticket:
    # What is sent to a replica: the admitted request, or its continuation after a move. `id` is
    # rewritten per replica (the stream id).
    request: target_pb2.SequenceRequest
    number: int  # arrival order at the gateway
    enqueued_at: float  # time.monotonic() when the gateway admitted it
    events: asyncio.Queue[target_pb2.SequenceEvent] = field(default_factory=asyncio.Queue)
    replica: Replica | None = None  # where it was sent last; None while it waits in the gateway
    dispatched_at: float | None = None  # when it was sent to `replica`
    started: bool = False  # `replica` has sent an event for it: moving it now means resuming it
    done: bool = False  # its last event is out (finished, failed or cancelled)
    generated: list[int] = field(default_factory=list)  # token ids received so far, on every replica
    resumes: int = 0  # times it was moved after it had started
    # Called with the reason each time it is resumed (the request pipeline's trace and metrics).
    on_resume: Callable[[str], None] = lambda why: None
    # The admitted request (a copy: `request` is rewritten).
    original: target_pb2.SequenceRequest = field(init=False)
    # Speculation stats (cumulative) of the attempts on replicas that were lost, and of the current one.
    _carried: common_pb2.SpeculationStats = field(init=False, default_factory=common_pb2.SpeculationStats)
    _attempt: common_pb2.SpeculationStats = field(init=False, default_factory=common_pb2.SpeculationStats)

    def __post_init__(self) -> None:
        self.original = target_pb2.SequenceRequest()
        self.original.CopyFrom(self.request)

    @property
    def gateway_queue_seconds(self) -> float:
        """Admission -> sent to the replica that serves it (time on a replica it was taken back
        from counts: it was waiting all along)."""
        return 0.0 if self.dispatched_at is None else self.dispatched_at - self.enqueued_at

    def deliver(self, event: target_pb2.SequenceEvent) -> None:
        """An event from the replica running it, on to the reader (stats made cumulative over
        every attempt)."""
        self.started = True
        self.generated.extend(event.token_ids)
        if self.resumes:
            self._attempt = common_pb2.SpeculationStats()
            self._attempt.CopyFrom(event.stats)
            event.stats.CopyFrom(merge_stats(self._carried, self._attempt))
        else:
            self._attempt = event.stats  # not changed after this
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.done = True
        self.events.put_nowait(event)

    def resume(self, why: str) -> bool:
        """Its replica is gone after it started: from now on it asks for its continuation (not
        started anywhere yet); True. If every token it asked for had arrived (only its final
        event was lost) it finishes here instead, with finish reason LENGTH; False."""
        assert self.started and not self.done
        self._carried = merge_stats(self._carried, self._attempt)
        self._attempt = common_pb2.SpeculationStats()
        self.started = False
        if len(self.generated) >= self.original.max_new_tokens:
            self.done = True
            self.events.put_nowait(target_pb2.SequenceEvent(
                id=self.request.id, finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=self._carried))
            return False
        self.request = continuation(self.original, self.generated)
        self.resumes += 1
        self.on_resume(why)
        return True

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Ends the ticket with an error event carrying `code`."""
        if self.done:
            return
        self.done = True
        error = common_pb2.SequenceError(code=code.value[0], message=message)
        self.events.put_nowait(target_pb2.SequenceEvent(
            id=self.request.id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error))
