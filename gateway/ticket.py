"""A request's place in the gateway from admission to its last event.

The request pipeline reads the ticket's `events`; the router and the replica it is sent to write
them. The queue stays the same when the router moves the request to another replica — before it
started there, or after (its *continuation*, gateway/resume.py, picks up after the tokens already
received) — so a move is invisible to the reader: the events read as one sequence's, with stats
counting every attempt. Requests and events are the engine's plain messages
(specstream/data/engine.py). Knows nothing about routing policy, gRPC streams or protobuf.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.resume import continuation, merge_stats
from specstream.data.engine import SequenceEvent, SequenceRequest, SequenceStats
from specstream.data.errors import SpecstreamError


class Replica(Protocol):
    """Where a ticket was sent (gateway/target_client.py's TargetClient): the router cancels it there."""

    def cancel(self, ticket: Ticket) -> bool:
        """Cancels the ticket's sequence if the replica still holds it; whether it did."""


@dataclass(eq=False)
class Ticket:
    # What is sent to a replica: the admitted request, or its continuation after a move; replaced,
    # never changed in place (a replica gives it its stream id as `id`).
    request: SequenceRequest
    number: int  # arrival order at the gateway
    enqueued_at: float  # time.monotonic() when the gateway admitted it
    events: asyncio.Queue[SequenceEvent] = field(default_factory=asyncio.Queue)
    replica: Replica | None = None  # where it was sent last; None while it waits in the gateway
    dispatched_at: float | None = None  # when it was sent to `replica`
    started: bool = False  # `replica` has sent an event for it: moving it now means resuming it
    done: bool = False  # its last event is out (finished, failed or cancelled)
    generated: list[int] = field(default_factory=list)  # token ids received so far, on every replica
    resumes: int = 0  # times it was moved after it had started
    # Called with the reason each time it is resumed (the request pipeline's trace and metrics).
    on_resume: Callable[[str], None] = lambda why: None
    # The admitted request (`request` as it was admitted).
    original: SequenceRequest = field(init=False)
    # Speculation stats (cumulative) of the attempts on replicas that were lost, and of the current one.
    _carried: SequenceStats = field(init=False, default_factory=SequenceStats)
    _attempt: SequenceStats = field(init=False, default_factory=SequenceStats)

    def __post_init__(self) -> None:
        self.original = self.request

    @property
    def gateway_queue_seconds(self) -> float:
        """Admission -> sent to the replica that serves it (time on a replica it was taken back
        from counts: it was waiting all along)."""
        return 0.0 if self.dispatched_at is None else self.dispatched_at - self.enqueued_at

    def send_as(self, stream_id: str) -> SequenceRequest:
        """The request to send to a replica under `stream_id` (it becomes `request`)."""
        self.request = dataclasses.replace(self.request, id=stream_id)
        return self.request

    def deliver(self, event: SequenceEvent) -> None:
        """An event from the replica running it, on to the reader; the event is handed over, and
        after a move its stats are replaced by the cumulative ones over every attempt."""
        self.started = True
        self.generated.extend(event.token_ids)
        self._attempt = event.stats
        if self.resumes:
            event.stats = merge_stats(self._carried, self._attempt)
        if event.finish_reason is not None:
            self.done = True
        self.events.put_nowait(event)

    def resume(self, why: str) -> bool:
        """Its replica is gone after it started: from now on it asks for its continuation (not
        started anywhere yet); True. If every token it asked for had arrived (only its final
        event was lost) it finishes here instead, with finish reason "length"; False."""
        assert self.started and not self.done
        self._carried = merge_stats(self._carried, self._attempt)
        self._attempt = SequenceStats()
        self.started = False
        if len(self.generated) >= self.original.max_new_tokens:
            self.done = True
            self.events.put_nowait(SequenceEvent(id=self.request.id, finish_reason="length", stats=self._carried))
            return False
        self.request = continuation(self.original, self.generated)
        self.resumes += 1
        self.on_resume(why)
        return True

    def fail(self, error: SpecstreamError) -> None:
        """Ends the ticket with an error event carrying `error` (its class gives the status)."""
        if self.done:
            return
        self.done = True
        self.events.put_nowait(SequenceEvent(id=self.request.id, finish_reason="error", error=error))
