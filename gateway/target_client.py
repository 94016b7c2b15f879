"""The gateway's side of `Target.Connect`: one multiplexed stream to one target replica.

Requests go out as Submit/Cancel messages (coalesced: everything queued since the last write goes
in one message); the target's per-step events go onto each request's `Ticket`. The client keeps
what the router needs to judge the replica's room: its latest `Load`, the gateway's requests on it
(`outstanding`) and how many were sent since that Load arrived (`sent_since_load`).

When the stream breaks, requests that had started (the target sent an event for them) fail with
UNAVAILABLE — part of their output is already with the caller — and the others are handed back to
the router to go to another replica; the client reconnects after `retry_s`. A second call,
grpc.health.v1 `Watch`, follows the target's health: a target that stops SERVING (it is shutting
down) gets no new requests, and its unstarted ones are cancelled there and handed back at once
instead of when its grace period ends.

Knows nothing about routing policy: the router sets `on_capacity` and `on_handback`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.ticket import Ticket
from specstream.channels import open_channel
from specstream.config import ChannelSecurity
from specstream_pb import common_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class TargetClient:
    def __init__(self, url: str, options: list | None = None, retry_s: float = 1.0,
                 security: ChannelSecurity | None = None) -> None:
        self.url = url
        self.retry_s = retry_s
        self._channel = open_channel(url, options, security)
        self._stub = target_pb2_grpc.TargetStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outgoing: asyncio.Queue[target_pb2.GatewayMessage] = asyncio.Queue()
        self._tickets: dict[str, Ticket] = {}  # by stream id: the gateway's requests on this replica
        self._tasks: list[asyncio.Task[None]] = []
        self.info = target_pb2.TargetInfo()
        self.load = target_pb2.Load()
        self.sent_since_load = 0  # requests submitted after `load` arrived, which it cannot count yet
        self.routed = 0  # requests ever sent here
        self.requeued = 0  # requests handed back before they started
        self.connected = False  # the Connect stream is up: the target has answered on it
        self.serving = False  # the target reports SERVING on grpc.health.v1
        self.on_capacity: Callable[[], None] = lambda: None  # the replica may have room now
        self.on_handback: Callable[[list[Ticket]], None] = lambda tickets: None  # route these elsewhere
        self.on_state: Callable[[], Awaitable[None]] | None = None  # `routable` may have changed
        # Ids on the stream are ours, not the caller's: a cancelled request's late events can
        # never reach a new request that reuses its public id.
        self._ids = itertools.count(1)

    @property
    def routable(self) -> bool:
        """New requests may go here."""
        return self.connected and self.serving

    @property
    def outstanding(self) -> int:
        """The gateway's requests on this replica that have not finished."""
        return len(self._tickets)

    async def start(self, timeout_s: float) -> None:
        """Waits for the target to answer GetInfo, then keeps a Connect stream and a health watch open."""
        self.info = await self._stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        self.load = self.info.load
        self._tasks = [asyncio.create_task(self._run(), name=f"target-stream {self.url}"),
                       asyncio.create_task(self._watch_health(), name=f"target-health {self.url}")]

    def submit(self, ticket: Ticket) -> None:
        """Sends the ticket's request under a fresh stream id."""
        assert self.connected, f"submit to {self.url} while its stream is down"
        stream_id = str(next(self._ids))
        ticket.request.id = stream_id
        ticket.replica = self
        self._tickets[stream_id] = ticket
        self.sent_since_load += 1
        self.routed += 1
        self._outgoing.put_nowait(target_pb2.GatewayMessage(submit=target_pb2.Submit(requests=[ticket.request])))

    def cancel(self, ticket: Ticket) -> bool:
        """Cancels the ticket's sequence if it is still here; whether it was."""
        stream_id = ticket.request.id
        if self._tickets.get(stream_id) is not ticket:
            return False
        del self._tickets[stream_id]
        self._outgoing.put_nowait(target_pb2.GatewayMessage(cancel=target_pb2.Cancel(ids=[stream_id])))
        return True

    # ----- the Connect stream ------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            call = self._stub.Connect()
            # The write side belongs to this call alone: a writer left over from a dead stream
            # would take (and lose) the next messages meant for the new one.
            writer = asyncio.create_task(self._write(call))
            try:
                async for message in call:
                    if not self.connected:
                        self.connected = True
                        self._on_message(message)
                        await self._notify_state()
                    else:
                        self._on_message(message)
                why = "stream ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            finally:
                writer.cancel()
            if self.connected:
                log.warning("target %s stream lost (%s); retrying every %.1fs", self.url, why, self.retry_s)
            self._lose(f"target {self.url} connection lost ({why})")
            await self._notify_state()
            await asyncio.sleep(self.retry_s)

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for message in self._messages():
                await call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream broke; the reader sees why and fails what was in flight

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
        if message.HasField("load"):
            self.load = message.load
            self.sent_since_load = 0
        for event in message.events.events:
            ticket = self._tickets.get(event.id)
            if ticket is None:
                continue  # cancelled or handed back by us; the target's last word on it
            ticket.started = True
            if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self._tickets[event.id]
                ticket.done = True
            ticket.events.put_nowait(event)
        self.on_capacity()

    def _lose(self, why: str) -> None:
        """The stream is gone (the target cancels everything it had from it): started requests
        fail, unstarted ones go back to the router."""
        self.connected = False
        self.load = target_pb2.Load(max_slots=self.load.max_slots)
        self.sent_since_load = 0
        _drain(self._outgoing)  # meant for the dead stream
        tickets = list(self._tickets.values())
        self._tickets.clear()
        for ticket in tickets:
            if ticket.started:
                ticket.fail(grpc.StatusCode.UNAVAILABLE, why)
        self._hand_back([t for t in tickets if not t.started])

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
            self.on_capacity()
        else:
            log.info("target %s is not serving; moving its unstarted requests elsewhere", self.url)
            self._take_back_unstarted()
        await self._notify_state()

    def _take_back_unstarted(self) -> None:
        """Cancels every request that has not started here and hands it back. An event already on
        its way for one of them is dropped: the caller has seen nothing of it, so it may run again
        elsewhere from the start."""
        unstarted = [t for t in self._tickets.values() if not t.started]
        for ticket in unstarted:
            self.cancel(ticket)
        self._hand_back(unstarted)

    def _hand_back(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            ticket.replica = None
            ticket.dispatched_at = None
        self.requeued += len(tickets)
        self.on_handback(tickets)

    async def _notify_state(self) -> None:
        if self.on_state is not None:
            await self.on_state()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._channel.close()


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
