"""``StreamBase``: the half of ``ResponseStream`` and ``AsyncResponseStream`` that does no I/O -- one
``GenerateStream`` call's state, cancelling it, and turning what it yields into ``StreamChunk``s or
the SDK's errors.

Contract: a stream is not started (``_running`` is None), then running, then done (the call ended,
failed or was cancelled); a done stream yields nothing more. A subclass starts the call on its first
``next`` (``_running = _call.start(stub)``) and takes each message inside ``with self._receiving():``,
which marks the stream done when the call ends (``StopIteration``/``StopAsyncIteration``) or fails,
and raises a failure as the SDK's exception (``errors.map_rpc_errors``), also after chunks were
yielded. ``cancel()`` cancels a running call, and so does dropping an unfinished stream (``__del__``),
which lets the server free the sequence before the deadline.

What it does not know: blocking or asyncio -- getting the stub, waiting for a message, and the
(async) iterator and context-manager protocols are the subclasses'.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import grpc
from google.protobuf.message import Message

from ._call import GENERATE_STREAM, Call
from .errors import map_rpc_errors
from .types import StreamChunk

__all__ = ["StreamBase"]


class StreamBase:
    """One ``GenerateStream`` call of ``request``; see the module docstring."""

    def __init__(
        self,
        request: Message,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self._call: Call[StreamChunk] = Call(GENERATE_STREAM, request, timeout, metadata)
        self._running: Any = None  # grpc's call once started: the messages' (async) iterator, and cancel()
        self._done = False

    def _receiving(self) -> _Receiving:
        return _Receiving(self)

    def cancel(self) -> None:
        if self._running is not None and not self._done:
            self._running.cancel()
        self._done = True

    def __del__(self) -> None:
        # Abandoned mid-stream (e.g. `break` out of a for loop): free the server's sequence now
        # rather than at the deadline. Nothing may raise out of __del__.
        try:
            self.cancel()
        except Exception:
            pass


class _Receiving(map_rpc_errors):
    """Around taking a stream's next message: the call's end or failure ends the stream, and a
    failure is raised as the SDK's exception."""

    def __init__(self, stream: StreamBase) -> None:
        self._stream = stream

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, StopIteration | StopAsyncIteration | grpc.RpcError):
            self._stream._done = True
        super().__exit__(exc_type, exc, tb)
