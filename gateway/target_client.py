"""The gateway's side of `Target.Connect`: one multiplexed stream to one target replica.

Requests go out as Submit/Cancel messages (coalesced: everything queued since the last write goes
in one message); the target's per-step Events are split into per-request queues. If the stream
breaks, every waiting request gets an UNAVAILABLE error event and the client reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc

from specstream_pb import common_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class TargetClient:
    def __init__(self, url: str, options: list | None = None, retry_s: float = 1.0) -> None:
        self.url = url
        self.retry_s = retry_s
        self._channel = grpc.aio.insecure_channel(url, options=options or [])
        self._stub = target_pb2_grpc.TargetStub(self._channel)
        self._outgoing: asyncio.Queue[target_pb2.GatewayMessage] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[target_pb2.SequenceEvent]] = {}
        self._task: asyncio.Task[None] | None = None
        self.info = target_pb2.TargetInfo()
        self.load = target_pb2.Load()
        self.connected = asyncio.Event()  # set once the target has answered on the stream
        self.on_state: Callable[[bool], Awaitable[None]] | None = None  # told when that changes
        # Ids on the stream are ours, not the caller's: a cancelled request's late events can
        # never reach a new request that reuses its public id.
        self._ids = itertools.count(1)

    async def start(self, timeout_s: float) -> None:
        """Waits for the target to answer GetInfo, then keeps a Connect stream open."""
        self.info = await self._stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        self.load = self.info.load
        self._task = asyncio.create_task(self._run(), name=f"target-stream {self.url}")

    def submit(self, request: target_pb2.SequenceRequest) -> tuple[str, asyncio.Queue[target_pb2.SequenceEvent]]:
        """Sends the request under a fresh stream id; returns that id and the queue of its events."""
        if not self.connected.is_set():
            raise ConnectionError(f"target {self.url} is not connected")
        stream_id = str(next(self._ids))
        request.id = stream_id
        queue: asyncio.Queue[target_pb2.SequenceEvent] = asyncio.Queue()
        self._queues[stream_id] = queue
        self._outgoing.put_nowait(target_pb2.GatewayMessage(submit=target_pb2.Submit(requests=[request])))
        return stream_id, queue

    def cancel(self, stream_id: str) -> None:
        if self._queues.pop(stream_id, None) is not None:
            self._outgoing.put_nowait(target_pb2.GatewayMessage(cancel=target_pb2.Cancel(ids=[stream_id])))

    async def _run(self) -> None:
        while True:
            call = self._stub.Connect()
            # The write side belongs to this call alone: a writer left over from a dead stream
            # would take (and lose) the next messages meant for the new one.
            writer = asyncio.create_task(self._write(call))
            try:
                async for message in call:
                    if not self.connected.is_set():
                        await self._set_connected(True)
                    self._dispatch(message)
                why = "stream ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            finally:
                writer.cancel()
            await self._set_connected(False)
            log.warning("target %s stream lost (%s); retrying in %.1fs", self.url, why, self.retry_s)
            self._fail_all(f"target {self.url} connection lost ({why})")
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

    async def _set_connected(self, up: bool) -> None:
        if up:
            self.connected.set()
        else:
            self.connected.clear()
        if self.on_state is not None:
            await self.on_state(up)

    def _dispatch(self, message: target_pb2.TargetMessage) -> None:
        if message.HasField("load"):
            self.load = message.load
        for event in message.events.events:
            queue = self._queues.get(event.id)
            if queue is None:
                continue  # cancelled by us; the target's last word on it
            queue.put_nowait(event)
            if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self._queues[event.id]

    def _fail_all(self, why: str) -> None:
        error = common_pb2.SequenceError(code=grpc.StatusCode.UNAVAILABLE.value[0], message=why)
        for request_id, queue in self._queues.items():
            queue.put_nowait(target_pb2.SequenceEvent(id=request_id, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                                      error=error))
        self._queues.clear()
        _drain(self._outgoing)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._channel.close()


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
