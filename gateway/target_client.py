"""The gateway's side of `Target.Connect`: one multiplexed stream to one target replica.

Requests go out as Submit/Cancel messages (coalesced: everything queued since the last write goes
in one message); the target's per-step events go onto each request's `Ticket`. The client keeps
what the router needs to judge the replica's room: its latest `Load`, the gateway's requests on it
(`outstanding`) and how many were sent since that Load arrived (`sent_since_load`).

**The protobuf edge.** This is where the gateway's requests become `target_pb2` messages and the
target's events, `Load`s and info become plain data again (specstream/data/engine_wire.py): the
router, tickets and the request pipeline speak the engine's own messages (specstream/data/engine.py),
as the target's engine does, and an error event's status comes back as its error class.

**Losing the replica.** The stream breaks (the target died, or keepalive found its connection
dead), or the step-progress watchdog (gateway/watchdog.py) finds that the replica has sent nothing
for too long while it holds our requests — then the client declares it hung and tears the stream
down (the target, if it ever runs again, cancels everything it had from that stream). Either way
every request it held is handed back to the router: those that had not started go elsewhere as
they are, and those that had started are *resumed* — their continuation (gateway/resume.py: the
prompt plus the tokens already received, the rest of the budget) goes to another replica and the
caller's stream carries on. The client reconnects after `retry_s` (doubled for each stall in a
row without progress in between, up to 32x, so a replica that answers but never steps is tried
less and less often). A second call, grpc.health.v1 `Watch`, follows the target's health: a
target that stops SERVING (it is shutting down) gets no new requests, and its unstarted ones are
cancelled there and handed back at once instead of when its grace period ends; the started ones
finish there, or move like the rest if the target ends them with UNAVAILABLE (its grace period
ran out). A *draining* replica (its address left DNS: gateway/membership.py) likewise gets
nothing new and hands back what has not started, and finishes what has.

The client is a `Replica` (gateway/ticket.py) and reports to the `ReplicaOwner` it is attached to
(the router) by name: `pump` when it may have room, `take_back` with the requests it hands back,
`recheck_serving` when `routable` may have changed. Before it is attached (while it starts) there
is nobody to tell and nothing of the owner's on it. Knows nothing about routing policy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.ticket import ReplicaOwner, Ticket
from gateway.watchdog import StepWatchdog
from specstream.data.batch_stats import BatchStats
from specstream.data.config import ChannelSecurity, StallConfig
from specstream.data.engine import Load, SequenceEvent, TargetInfo
from specstream.data.engine_wire import event_from_pb, info_from_pb, load_from_pb, request_to_pb
from specstream.serving.channels import open_channel
from specstream_pb import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

MAX_STALL_BACKOFF = 32  # the reconnect delay after stalls in a row is at most this many retry_s


class TargetClient:
    def __init__(self, url: str, options: list | None = None, retry_s: float = 1.0,
                 stall: StallConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 security: ChannelSecurity | None = None) -> None:
        self.url = url
        self.retry_s = retry_s
        self._channel = open_channel(url, options, security)
        self._stub = target_pb2_grpc.TargetStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outgoing: asyncio.Queue[target_pb2.GatewayMessage] = asyncio.Queue()
        self._tickets: dict[str, Ticket] = {}  # by stream id: the gateway's requests on this replica
        self._tasks: list[asyncio.Task[None]] = []
        self._call: grpc.aio.StreamStreamCall | None = None  # the Connect stream now open
        self._clock = clock
        self.watchdog = StepWatchdog(stall or StallConfig())
        self._stalls_in_a_row = 0  # stalls with no progress in between: the reconnect delay doubles with each
        self.info = TargetInfo()
        self.load = _unknown_load()
        self.sent_since_load = 0  # requests submitted after `load` arrived, which it cannot count yet
        self.routed = 0  # requests ever sent here
        self.requeued = 0  # requests handed back before they started
        self.resumed = 0  # requests moved elsewhere after they had started here
        self.stalls = 0  # times the watchdog declared it hung
        self.connected = False  # the Connect stream is up: the target has answered on it
        self.serving = False  # the target reports SERVING on grpc.health.v1
        self.draining = False  # its address left DNS: finish what runs, take nothing new
        self._owner: ReplicaOwner | None = None  # the router, once attached
        # Ids on the stream are ours, not the caller's: a cancelled request's late events can
        # never reach a new request that reuses its public id.
        self._ids = itertools.count(1)

    @property
    def routable(self) -> bool:
        """New requests may go here."""
        return self.connected and self.serving and not self.draining

    @property
    def outstanding(self) -> int:
        """The gateway's requests on this replica that have not finished."""
        return len(self._tickets)

    def attach(self, owner: ReplicaOwner) -> None:
        """From now on it tells `owner` of room, hand-backs and state changes."""
        assert self._owner in (None, owner), f"{self.url} already reports to another owner"
        self._owner = owner

    async def start(self, timeout_s: float) -> None:
        """Waits for the target to answer GetInfo, then keeps a Connect stream and a health watch
        open, and the watchdog on the stream."""
        self.info = info_from_pb(await self._stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=timeout_s,
                                                          wait_for_ready=True))
        self.load = self.info.load or _unknown_load()
        self._tasks = [asyncio.create_task(self._run(), name=f"target-stream {self.url}"),
                       asyncio.create_task(self._watch_health(), name=f"target-health {self.url}"),
                       asyncio.create_task(self._watch_progress(), name=f"target-watchdog {self.url}")]

    def submit(self, ticket: Ticket) -> None:
        """Sends the ticket's request under a fresh stream id."""
        assert self.connected, f"submit to {self.url} while its stream is down"
        stream_id = str(next(self._ids))
        request = request_to_pb(ticket.send_as(stream_id))
        ticket.replica = self
        self._track(stream_id, ticket)
        self.sent_since_load += 1
        self.routed += 1
        self._outgoing.put_nowait(target_pb2.GatewayMessage(submit=target_pb2.Submit(requests=[request])))

    def cancel(self, ticket: Ticket) -> bool:
        """Cancels the ticket's sequence if it is still here; whether it was."""
        stream_id = ticket.request.id
        if self._tickets.get(stream_id) is not ticket:
            return False
        self._untrack(stream_id)
        self._outgoing.put_nowait(target_pb2.GatewayMessage(cancel=target_pb2.Cancel(ids=[stream_id])))
        return True

    async def drain(self, draining: bool = True) -> None:
        """Takes no new requests and hands back the unstarted ones (True), or takes them again."""
        if draining == self.draining:
            return
        self.draining = draining
        if draining:
            self._take_back_unstarted(f"target {self.url} is draining")
        else:
            self._room_freed()
        await self._routable_changed()

    def _track(self, stream_id: str, ticket: Ticket) -> None:
        if not self._tickets:
            self.watchdog.work_started(self._clock())
        self._tickets[stream_id] = ticket

    def _untrack(self, stream_id: str) -> None:
        del self._tickets[stream_id]
        if not self._tickets:
            self.watchdog.work_ended()

    # ----- the Connect stream ------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            call = self._call = self._stub.Connect()
            self.watchdog.reset()
            # The write side belongs to this call alone: a writer left over from a dead stream
            # would take (and lose) the next messages meant for the new one.
            writer = asyncio.create_task(self._write(call))
            try:
                why = await self._read(call)
            finally:
                writer.cancel()
            if self.connected:
                log.warning("target %s stream lost (%s); retrying every %.1fs", self.url, why, self.retry_s)
            self._lose(f"target {self.url} connection lost ({why})")
            await self._routable_changed()
            await asyncio.sleep(self.retry_s * min(2 ** self._stalls_in_a_row, MAX_STALL_BACKOFF))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> str:
        """Reads the stream until it ends; why it did."""
        try:
            async for message in call:
                if self._call is not call:  # the watchdog gave up on this stream
                    return "stalled"
                if not self.connected:
                    self.connected = True
                    self._on_message(message)
                    await self._routable_changed()
                else:
                    self._on_message(message)
            return "stream ended"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            if self._call is call or asyncio.current_task().cancelling():
                raise  # our task is being cancelled (close), not the call by the watchdog
            return "stalled"

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for message in self._messages():
                await call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream broke; the reader sees why and hands back what was in flight

    async def _messages(self):
        while True:
            first = await self._outgoing.get()
            submits, cancels = [], []
            for message in [first, *_drain(self._outgoing)]:
                if message.HasField("submit"):
                    submits.extend(message.submit.requests)
                else:
                    cancels.extend(message.cancel.ids)
            if submits:
                yield target_pb2.GatewayMessage(submit=target_pb2.Submit(requests=submits))
            if cancels:
                yield target_pb2.GatewayMessage(cancel=target_pb2.Cancel(ids=cancels))

    def _on_message(self, message: target_pb2.TargetMessage) -> None:
        if self.watchdog.busy:
            self._stalls_in_a_row = 0  # it stepped while it had our work: not wedged
        self.watchdog.heard(self._clock())
        if message.HasField("load"):
            self.load = load_from_pb(message.load)
            self.sent_since_load = 0
        for pb in message.events.events:
            ticket = self._tickets.get(pb.id)
            if ticket is None:
                continue  # cancelled or handed back by us; the target's last word on it
            event = event_from_pb(pb)
            if event.finish_reason is not None:
                self._untrack(event.id)
            if _gave_up(event):  # the target is going away: another replica carries on
                self._move([ticket], f"target {self.url}: {event.error}")
                continue
            ticket.deliver(event)
        self._room_freed()

    def _lose(self, why: str) -> None:
        """The stream is gone (the target cancels everything it had from it): every request goes
        back to the router, the started ones as their continuations."""
        self.connected = False
        self.load = _unknown_load(self.load.max_slots)
        self.sent_since_load = 0
        _drain(self._outgoing)  # meant for the dead stream
        tickets = list(self._tickets.values())
        self._tickets.clear()
        self.watchdog.work_ended()
        self._move(tickets, why)

    def _move(self, tickets: list[Ticket], why: str) -> None:
        """Hands requests that can no longer run here back to the router, the started ones as
        their continuations."""
        started = [t for t in tickets if t.started]
        resumed = [t for t in started if t.resume(why)]  # the others had all their tokens: finished
        self.resumed += len(resumed)
        unstarted = [t for t in tickets if t not in started]
        self._hand_back(unstarted + resumed, why, unstarted=len(unstarted))

    # ----- the watchdog ------------------------------------------------------------------------
    async def _watch_progress(self) -> None:
        tick = min(0.1, self.watchdog.config.floor_s / 4)
        while True:
            due = self._clock() + tick
            await asyncio.sleep(tick)
            # A late tick means this event loop was held up, and messages may be waiting unread:
            # judge the silence as of when the tick was due.
            self.check_progress(min(self._clock(), due))

    def check_progress(self, now: float) -> bool:
        """Declares the replica hung if it holds our requests and has been silent until `now`
        past its deadline: its stream is torn down and its requests move. Whether it did."""
        if self._call is None or not self.connected or not self.watchdog.stalled(now):
            return False
        silence, deadline = self.watchdog.silence(now), self.watchdog.deadline()
        log.warning("target %s sent nothing for %.2fs with %d request(s) outstanding (deadline %.2fs); "
                    "declaring it hung and moving its requests", self.url, silence, self.outstanding, deadline)
        self.stalls += 1
        self._stalls_in_a_row += 1
        call, self._call = self._call, None
        self._lose(f"target {self.url} hung (nothing for {silence:.1f}s, deadline {deadline:.1f}s)")
        call.cancel()  # its reader then tells the owner `routable` changed, and reconnects
        return True

    # ----- health ------------------------------------------------------------------------------
    async def _watch_health(self) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                async for reply in self._health.Watch(request):
                    await self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._set_serving(True)  # no health service: the stream alone decides
                    return
            await self._set_serving(False)
            await asyncio.sleep(self.retry_s)

    async def _set_serving(self, serving: bool) -> None:
        if serving == self.serving:
            return
        self.serving = serving
        if serving:
            self._room_freed()
        else:
            log.info("target %s is not serving; moving its unstarted requests elsewhere", self.url)
            self._take_back_unstarted(f"target {self.url} is not serving")
        await self._routable_changed()

    def _take_back_unstarted(self, why: str) -> None:
        """Cancels every request that has not started here and hands it back. An event already on
        its way for one of them is dropped: the caller has seen nothing of it from here, so it may
        run elsewhere as it was sent here."""
        unstarted = [t for t in self._tickets.values() if not t.started]
        for ticket in unstarted:
            self.cancel(ticket)
        self._hand_back(unstarted, why, unstarted=len(unstarted))

    def _hand_back(self, tickets: list[Ticket], why: str, unstarted: int) -> None:
        for ticket in tickets:
            ticket.replica = None
            ticket.dispatched_at = None
        self.requeued += unstarted
        if self._owner is not None:
            self._owner.take_back(tickets, why)
        else:
            assert not tickets, f"{self.url} holds requests but reports to nobody"

    # ----- telling the owner -------------------------------------------------------------------
    def _room_freed(self) -> None:
        if self._owner is not None:
            self._owner.pump()

    async def _routable_changed(self) -> None:
        if self._owner is not None:
            await self._owner.recheck_serving()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._channel.close()


def _unknown_load(max_slots: int = 0) -> Load:
    """A replica's load while it reports none (before its first report, or once its stream is
    gone): its slots if known, nothing running and no room."""
    batch = BatchStats(policy="", max_batch=0)
    batch.occupancy = []  # nothing reported
    return Load(max_slots=max_slots, free_slots=0, running=0, queued=0, draft_sequences=0, draft_connected=False,
                batch=batch)


def _gave_up(event: SequenceEvent) -> bool:
    """The target ended the sequence with UNAVAILABLE (its engine is shutting down, e.g. at the
    end of its grace period): not the request's fault, so it moves instead of failing."""
    return (event.finish_reason == "error" and event.error is not None
            and event.error.code == grpc.StatusCode.UNAVAILABLE)


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
