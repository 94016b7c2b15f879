"""A request's place in the gateway from admission to its last event, and the two sides it moves
between: the `Replica` it is sent to and the `ReplicaOwner` (the router) a replica hands it back to.

The request pipeline reads the ticket's `events`; the router and the replica it is sent to write
them. The queue stays the same when the router moves the request to another replica — before it
started there, or after (its *continuation*, gateway/resume.py, picks up after the tokens already
received) — so a move is invisible to the reader: the events read as one sequence's, with stats
counting every attempt; the reader hears of each resume through its `TicketWatcher`. Requests and
events are the engine's plain messages (specstream/data/engine.py).

**Losing a replica**, as named calls: the replica (gateway/target_client.py's TargetClient) is
attached to its owner once (`Replica.attach`), and then tells it `pump` when it may have room,
`take_back` with the requests it can no longer run (the started ones resumed first, `Ticket.resume`,
which tells the ticket's watcher `resumed`), and `recheck_serving` when its `routable` may have
changed. The protocols are declared here, beside the ticket, because each names the other: the
ticket records its replica, and a replica takes and hands back tickets.

Knows nothing about routing policy, gRPC streams or protobuf.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from gateway.resume import continuation, merge_stats
from specstream.data.engine import Load, SequenceEvent, SequenceRequest, SequenceStats
from specstream.data.errors import SpecstreamError


class ReplicaOwner(Protocol):
    """Who a replica reports to (gateway/router.py's Router). A replica calls these from its own
    stream, health and watchdog tasks and from `drain`, never from inside the owner's own calls to
    it (`submit`, `cancel`): the owner is never re-entered."""

    def pump(self) -> None:
        """The replica may have room now (a request finished or was cancelled, a Load report came,
        it serves again or stopped draining): send what waits while some replica has room."""

    def take_back(self, tickets: list[Ticket], why: str) -> None:
        """Requests the replica can no longer run (`why`: what happened to it), each either not
        started or already resumed (asking for its continuation), and none of them on the replica
        any more: send them elsewhere. Also called with none when the replica stops taking new
        requests, since what waits may then have nowhere left to go."""

    async def recheck_serving(self) -> None:
        """The replica's `routable` may have changed (its stream came up or went down, its health
        or draining changed): whether any replica is routable may have."""


class Replica(Protocol):
    """A target replica as the router, the membership and tickets use it (gateway/target_client.py's
    TargetClient; tests play it with the same class, its stream never opened). Until `attach` it
    reports to nobody."""

    url: str  # its address, as configured or resolved
    load: Load  # its latest Load report (no room while it reports none)
    sent_since_load: int  # requests submitted after `load` arrived, which it cannot count yet
    routed: int  # requests ever sent here

    @property
    def routable(self) -> bool:
        """New requests may go here."""

    @property
    def outstanding(self) -> int:
        """The gateway's requests on this replica that have not finished."""

    def attach(self, owner: ReplicaOwner) -> None:
        """From now on it tells `owner` of room, hand-backs and state changes (once, by its router)."""

    def submit(self, ticket: Ticket) -> None:
        """Runs the ticket's request here (it becomes the ticket's `replica`); only while `routable`."""

    def cancel(self, ticket: Ticket) -> bool:
        """Cancels the ticket's sequence if the replica still holds it; whether it did."""

    async def drain(self, draining: bool = True) -> None:
        """Takes nothing new and hands back what has not started (True), or takes requests again."""

    async def close(self) -> None:
        """Stops its tasks and closes its connection."""


class TicketWatcher(Protocol):
    """Hears of a ticket's moves (the request pipeline, gateway/request.py: its trace and metrics)."""

    def resumed(self, why: str, tokens_before: int) -> None:
        """The ticket's replica was lost (`why`) after `tokens_before` tokens had arrived; it
        continues on another one."""


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
    watcher: TicketWatcher | None = None  # told of each resume (the request pipeline's trace and metrics)
    # Cache-aware routing (gateway/prefix_routing.py): the request its prompt's block keys were
    # computed for, and them; the prompt tokens the chosen replica was believed to hold.
    prefix_keys: tuple[SequenceRequest, list[bytes]] | None = None
    expected_cached: int = 0
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
        if self.watcher is not None:
            self.watcher.resumed(why, tokens_before=len(self.generated))
        return True

    def fail(self, error: SpecstreamError) -> None:
        """Ends the ticket with an error event carrying `error` (its class gives the status)."""
        if self.done:
            return
        self.done = True
        self.events.put_nowait(SequenceEvent(id=self.request.id, finish_reason="error", error=error))
