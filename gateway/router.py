"""Admission queue and replica choice: which target replica gets a request, and when.

A request goes to a replica only when that replica has room. Until then it waits here, in one FIFO
queue bounded by `max_queue`; a request that finds the queue full is refused at once with
RESOURCE_EXHAUSTED (never left to hang), and so is one that arrives while no replica is serving
(UNAVAILABLE). A queued request that is cancelled, or whose deadline passes, simply leaves the queue.

**Capacity.** A replica with `max_slots` slots may hold `max_slots + backlog` of the gateway's
requests. The backlog (default: `max_slots`) waits in the target's own queue, so a slot freed
when a sequence finishes is refilled by the engine's very next step instead of after the Load
report has reached the gateway and a Submit has come back. How much a replica holds is estimated as

    in_use = max(outstanding, load.running + load.queued + sent_since_load)

`outstanding` is this gateway's unfinished requests on it — exact, counted as requests are sent and
as their last events arrive. The Load term also counts other gateways' requests; `sent_since_load`
adds what was sent after that report, so a burst between two reports cannot oversubscribe it.

**Choice.** Of the routable replicas (stream up, SERVING) with room, the one believed to hold the
longest prefix of the request's prompt in its prefix cache (gateway/prefix_routing.py: the blocks
this gateway routed there), unless it holds more than `imbalance` requests above the least loaded
one; otherwise, and when none holds any, the one with the smallest `in_use / capacity`, ties to the
one sent the fewest requests, so a trickle alternates.

**Moves.** A replica that loses its stream or is declared hung hands back every request it held:
those that had not started (no event yet) as they were, those that had as their continuations
(gateway/resume.py), so the caller's stream carries on where it was. One that stops serving or
is draining hands back only its unstarted requests and finishes the others. Handed-back requests
go to the front of the queue, oldest first, ahead of newer arrivals and regardless of
`max_queue`, and move to another replica as soon as one has room. When no replica is routable any
more, everything queued fails with UNAVAILABLE: a request is lost only when no replica remains.

**Membership.** Replicas may be added and removed while the gateway runs (gateway/membership.py
re-resolves DNS); a removed replica must have nothing outstanding.

**Owner.** The router is the `ReplicaOwner` (gateway/ticket.py) of every replica it is given: a
replica calls `pump` when it may have room, `take_back` with what it hands back, and
`recheck_serving` when its `routable` may have changed, which the router passes on to
`on_serving_changed` (the gateway's health follows `serving`).

Knows nothing about tokens, text, gRPC streams or protobuf.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from gateway.prefix_routing import PrefixRouting
from gateway.ticket import Replica, Ticket
from specstream.data.engine import SequenceRequest
from specstream.data.errors import OverloadedError, UnavailableError


class Router:
    """The `ReplicaOwner` of its replicas."""

    def __init__(self, replicas: Sequence[Replica], max_queue: int, backlog: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_serving_changed: Callable[[], Awaitable[None]] | None = None,
                 prefixes: PrefixRouting | None = None) -> None:
        """``prefixes``: cache-aware choice (None: by load alone)."""
        assert replicas, "a router needs at least one replica"
        self.replicas = list(replicas)
        self.max_queue = max_queue
        self.backlog = backlog  # None: each replica's own max_slots
        self._clock = clock
        self._on_serving_changed = on_serving_changed  # awaited whenever `serving` may have changed
        self._waiting: deque[Ticket] = deque()
        self._numbers = itertools.count()
        self.prefixes = prefixes
        for replica in self.replicas:
            replica.attach(self)

    def add(self, replica: Replica) -> None:
        """A new replica; it takes requests once it is routable."""
        replica.attach(self)
        self.replicas.append(replica)
        self.pump()

    def remove(self, replica: Replica) -> None:
        """Forgets a replica that holds none of our requests (drained, or lost)."""
        assert replica.outstanding == 0, f"{replica.url} still holds {replica.outstanding} requests"
        self.replicas.remove(replica)
        if self.prefixes is not None:
            self.prefixes.forget(replica.url)
        if not self.serving:
            self._fail_waiting("no target replica is serving")

    @property
    def serving(self) -> bool:
        """Some replica can take new requests."""
        return any(r.routable for r in self.replicas)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def capacity(self, replica: Replica) -> int:
        slots = replica.load.max_slots
        return slots + (slots if self.backlog is None else self.backlog)

    @staticmethod
    def in_use(replica: Replica) -> int:
        load = replica.load
        return max(replica.outstanding, load.running + load.queued + replica.sent_since_load)

    def submit(self, request: SequenceRequest) -> Ticket:
        """Admits a request: sent to a replica now, or queued. Raises UnavailableError when no
        replica is serving and OverloadedError when the queue is full."""
        if not self.serving:
            raise UnavailableError(f"no target replica is serving ({', '.join(r.url for r in self.replicas)}); "
                                   "retry later")
        ticket = Ticket(request, number=next(self._numbers), enqueued_at=self._clock())
        if not self._waiting:  # FIFO: nobody may overtake a queued request
            replica = self._choose(ticket)
            if replica is not None:
                self._send(ticket, replica)
                return ticket
        if len(self._waiting) >= self.max_queue:
            raise OverloadedError(f"gateway queue is full: {len(self._waiting)} requests are waiting for a target "
                                  f"slot (max_queue={self.max_queue}); retry later")
        self._waiting.append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller has gone (cancel, deadline, stop string) or its request finished: let it go
        wherever it is. A no-op for a ticket that already finished."""
        ticket.done = True
        if ticket.replica is not None:
            if ticket.replica.cancel(ticket):
                self.pump()
        elif ticket in self._waiting:
            self._waiting.remove(ticket)

    def pump(self) -> None:
        """Sends queued requests, oldest first, while some replica has room."""
        while self._waiting:
            replica = self._choose(self._waiting[0])
            if replica is None:
                return
            self._send(self._waiting.popleft(), replica)

    def take_back(self, tickets: list[Ticket], why: str) -> None:
        """Requests a replica handed back (`why`: what happened to it): to the front of the queue,
        oldest first."""
        back = sorted((t for t in tickets if not t.done), key=lambda t: t.number)
        self._waiting.extendleft(reversed(back))
        if not self.serving:
            self._fail_waiting(f"no target replica is serving ({why})")
        else:
            self.pump()

    async def recheck_serving(self) -> None:
        """A replica's `routable` may have changed, or the set of replicas did: tells
        `on_serving_changed`, which reads `serving`."""
        if self._on_serving_changed is not None:
            await self._on_serving_changed()

    def _choose(self, ticket: Ticket) -> Replica | None:
        room = [r for r in self.replicas if r.routable and self.in_use(r) < self.capacity(r)]
        if not room:
            return None

        def load(replica: Replica) -> tuple[float, int]:
            return self.in_use(replica) / self.capacity(replica), replica.routed

        if self.prefixes is None:
            return min(room, key=load)
        if ticket.prefix_keys is None or ticket.prefix_keys[0] is not ticket.request:  # new, or a continuation
            ticket.prefix_keys = (ticket.request, self.prefixes.keys(ticket.request))
        best, ticket.expected_cached = self.prefixes.choose(room, ticket.prefix_keys[1], lambda r: r.url, load,
                                                            self.in_use)
        return best

    def _send(self, ticket: Ticket, replica: Replica) -> None:
        ticket.dispatched_at = self._clock()
        if self.prefixes is not None and ticket.prefix_keys is not None:
            self.prefixes.routed(replica.url, ticket.prefix_keys[1])
        replica.submit(ticket)

    def _fail_waiting(self, why: str) -> None:
        message = f"{why}; replicas: {', '.join(r.url for r in self.replicas) or 'none'}"
        while self._waiting:
            self._waiting.popleft().fail(UnavailableError(message))
