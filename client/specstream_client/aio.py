"""asyncio client for the specstream gateway (the ``specstream.v1.Generation`` service).

Contract: same methods and errors as ``Client``, as coroutines; ``generate_stream`` returns an
async iterator. The ``grpc.aio`` channel is created on first use, inside the running event loop,
so an ``AsyncClient`` may be constructed outside any loop; it must then be used from that one
loop only. Cancelling the awaiting task cancels the RPC (asyncio.CancelledError propagates
unchanged; the SDK's ``Cancelled`` means the *RPC* ended with status CANCELLED).

What it does not know: retries (none are made), load balancing, and server limits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from specstream_pb import generation_pb2, generation_pb2_grpc

from ._credentials import Credentials, PemSource
from ._request import build_chat_request, build_generate_request, parse_target, resolve_timeout
from .errors import from_rpc_error
from .options import GenerateOptions
from .types import GenerateResult, ModelInfo, StreamChunk

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import GenerateOptionsDict

__all__ = ["AsyncClient", "AsyncResponseStream"]


class AsyncResponseStream(AsyncIterator[StreamChunk]):
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
        self._client = client
        self._request = request
        self._timeout = timeout
        self._call: Any = None  # grpc.aio.UnaryStreamCall
        self._iter: AsyncIterator[Any] | None = None
        self._done = False

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._iter is None:
                stub = self._client._get_stub()
                self._call = stub.GenerateStream(self._request, timeout=self._timeout, metadata=self._client._metadata)
                self._iter = self._call.__aiter__()
            msg = await self._iter.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except grpc.RpcError as err:
            self._done = True
            raise from_rpc_error(err) from err
        return StreamChunk.from_pb(msg)

    def cancel(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True

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

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:
            pass


class AsyncClient:
    """asyncio counterpart of ``Client``; same arguments (security ones included, checked here)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        server_name: str | None = None,
        token: str | None = None,
    ) -> None:
        target, scheme = parse_target(url)
        self.timeout: float | None = resolve_timeout(None, timeout)
        self.target: str = target
        self._credentials = Credentials.from_options(scheme, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                                     server_name=server_name, token=token)
        self._metadata = self._credentials.metadata
        self._options = [*options, *self._credentials.channel_options()]
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None
        self._closed = False

    def _get_stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._closed:
            raise RuntimeError("AsyncClient is closed")
        if self._stub is None:
            # Created lazily: grpc.aio binds a channel to the event loop running at creation.
            channel_credentials = self._credentials.channel_credentials()
            if channel_credentials is not None:
                self._channel = grpc.aio.secure_channel(self.target, channel_credentials, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
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
        request = build_generate_request(prompt, options, **overrides)
        deadline = resolve_timeout(timeout, self.timeout)
        try:
            response = await self._get_stub().Generate(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        return GenerateResult.from_pb(response)

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> AsyncResponseStream:
        """See ``Client.generate_stream``; use with ``async for``. Arguments are checked now."""
        request = build_generate_request(prompt, options, **overrides)
        return AsyncResponseStream(self, request, resolve_timeout(timeout, self.timeout))

    async def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """See ``Client.chat``."""
        request = build_chat_request(messages, options, **overrides)
        deadline = resolve_timeout(timeout, self.timeout)
        try:
            response = await self._get_stub().Generate(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        return GenerateResult.from_pb(response)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, str]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> AsyncResponseStream:
        """See ``Client.chat_stream``; use with ``async for``. Arguments are checked now."""
        request = build_chat_request(messages, options, **overrides)
        return AsyncResponseStream(self, request, resolve_timeout(timeout, self.timeout))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        deadline = resolve_timeout(timeout, self.timeout)
        try:
            response = await self._get_stub().GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=deadline, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        return ModelInfo.from_pb(response)

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
