"""A request's place in the gateway from admission to its last event.

The request pipeline reads the ticket's `events`; the router and the replica it is sent to write
them. The queue stays the same when the router moves an unstarted request to another replica, so a
move is invisible to the reader. Knows nothing about routing policy or about gRPC streams.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from specstream_pb import common_pb2, target_pb2

if TYPE_CHECKING:
    from gateway.target_client import TargetClient


@dataclass(eq=False)
class Ticket:
    request: target_pb2.SequenceRequest  # `id` is rewritten per replica (the stream id)
    number: int  # arrival order at the gateway
    enqueued_at: float  # time.monotonic() when the gateway admitted it
    events: asyncio.Queue[target_pb2.SequenceEvent] = field(default_factory=asyncio.Queue)
    replica: TargetClient | None = None  # where it was sent last; None while it waits in the gateway
    dispatched_at: float | None = None  # when it was sent to `replica`
    started: bool = False  # `replica` has sent an event for it: it can no longer move
    done: bool = False  # its last event is out (finished, failed or cancelled)

    @property
    def gateway_queue_seconds(self) -> float:
        """Admission -> sent to the replica that serves it (time on a replica it was taken back
        from counts: it was waiting all along)."""
        return 0.0 if self.dispatched_at is None else self.dispatched_at - self.enqueued_at

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Ends the ticket with an error event carrying `code`."""
        if self.done:
            return
        self.done = True
        error = common_pb2.SequenceError(code=code.value[0], message=message)
        self.events.put_nowait(target_pb2.SequenceEvent(
            id=self.request.id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error))
