"""asyncio client for the specstream gateway (the ``specstream.v1.Generation`` service).

Contract: same methods and errors as ``Client``, as coroutines; ``generate_stream`` returns an
async iterator. The ``grpc.aio`` channel is created on first use, inside the running event loop,
so an ``AsyncClient`` may be constructed outside any loop; it must then be used from that one
loop only. Cancelling the awaiting task cancels the RPC (asyncio.CancelledError propagates
unchanged; the SDK's ``Cancelled`` means the *RPC* ended with status CANCELLED).

This module is the asyncio I/O only: everything else is the code ``Client`` runs too
(``ClientBase``, ``StreamBase``, ``_request.py``, ``types.py``, ``errors.py``).

What it does not know: retries (none are made), load balancing, and server limits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc.aio
from google.protobuf.message import Message

from specstream_pb import generation_pb2, generation_pb2_grpc

from ._base import ClientBase
from ._call import GENERATE, GET_MODEL_INFO, R, Rpc
from ._request import build_chat_request, build_generate_request
from ._stream import StreamBase
from .errors import map_rpc_errors
from .options import GenerateOptions
from .types import GenerateResult, ModelInfo, StreamChunk

if TYPE_CHECKING:
    # For type checkers only: typing_extensions is not a runtime dependency of the SDK (grpcio and
    # protobuf are), and `from __future__ import annotations` leaves the annotations unevaluated.
    from typing_extensions import Unpack

    from .options import GenerateOptionsDict

__all__ = ["AsyncClient", "AsyncResponseStream"]


class AsyncResponseStream(StreamBase, AsyncIterator[StreamChunk]):
    """Async iterator over one ``GenerateStream`` call. The RPC starts on the first
    ``__anext__``; ``aclose()``/``cancel()`` (or leaving ``async with``) cancels it if still
    running. Use ``async with`` when you may stop early: an abandoned async iterator is otherwise
    only cancelled when it is garbage-collected."""

    def __init__(
        self,
        client: AsyncClient,
        request: generation_pb2.GenerateRequest,
        timeout: float | None,
    ) -> None:
        super().__init__(request, timeout, client._metadata)
        self._client = client
        self._messages: AsyncIterator[Any] | None = None  # the started call's

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        with self._receiving():
            if self._messages is None:
                self._running = self._call.start(self._client._get_stub())
                self._messages = self._running.__aiter__()
            message = await self._messages.__anext__()
        return self._call.parse(message)

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncClient(ClientBase):
    """asyncio counterpart of ``Client``; same arguments (security ones included, checked here)."""

    def _open(self) -> None:
        # Deferred to first use (_get_stub): grpc.aio binds a channel to the event loop running when
        # it is made, and the client may be made outside any.
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None
        self._closed = False

    def _get_stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._closed:
            raise RuntimeError("AsyncClient is closed")
        if self._stub is None:
            self._channel = self._open_channel(grpc.aio)
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self._stub

    async def generate(
        self,
        prompt: str | Sequence[int],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """See ``Client.generate``."""
        return await self._unary(GENERATE, build_generate_request(prompt, options, **overrides), timeout)

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> AsyncResponseStream:
        """See ``Client.generate_stream``; use with ``async for``. Arguments are checked now."""
        return self._stream(build_generate_request(prompt, options, **overrides), timeout)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """See ``Client.chat``."""
        return await self._unary(GENERATE, build_chat_request(messages, options, **overrides), timeout)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> AsyncResponseStream:
        """See ``Client.chat_stream``; use with ``async for``. Arguments are checked now."""
        return self._stream(build_chat_request(messages, options, **overrides), timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._unary(GET_MODEL_INFO, generation_pb2.GetModelInfoRequest(), timeout)

    async def _unary(self, rpc: Rpc[R], request: Message, timeout: float | None) -> R:
        call = self._call(rpc, request, timeout)
        with map_rpc_errors():
            response = await call.start(self._get_stub())
        return call.parse(response)

    def _stream(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> AsyncResponseStream:
        return AsyncResponseStream(self, request, self._deadline(timeout))

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
