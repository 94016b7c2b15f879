"""Synchronous client for the specstream gateway (the ``specstream.v1.Generation`` service).

Contract: one ``Client`` owns one gRPC channel (thread-safe; share it between threads). Every
failed RPC -- including one that fails after a stream has yielded chunks -- raises a
``SpecstreamError`` subclass chosen by status code. A stream that is closed, garbage-collected or
abandoned by ``break`` cancels its RPC, which lets the server free the sequence.

This module is the blocking I/O only: the constructor and the calls each method makes are
``ClientBase``'s (``_base.py``), a stream's state is ``StreamBase``'s (``_stream.py``), requests
are built by ``_request.py``, responses parsed by ``types.py`` and errors mapped by ``errors.py``
-- the same code as ``AsyncClient``'s.

What it does not know: retries (none are made: a failed ``Generate`` may have run on the server),
load balancing across gateways, and server limits (see ``model_info()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
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

__all__ = ["Client", "ResponseStream"]


class ResponseStream(StreamBase, Iterator[StreamChunk]):
    """Iterator over one ``GenerateStream`` call. The RPC starts on the first ``next()``;
    ``close()``/``cancel()`` (or leaving a ``with`` block) cancels it if still running."""

    def __init__(
        self,
        stub: generation_pb2_grpc.GenerationStub,
        request: generation_pb2.GenerateRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        super().__init__(request, timeout, metadata)
        self._stub = stub

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        if self._running is None:
            self._running = self._call.start(self._stub)
        with self._receiving():
            message = next(self._running)
        return self._call.parse(message)

    close = StreamBase.cancel

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class Client(ClientBase):
    """Blocking client. ``url`` is ``"host:port"`` or ``"grpc://host:port"`` (``"grpcs://"`` uses
    TLS). ``timeout`` is the default per-call deadline in seconds (None: no deadline); ``options``
    are passed to the gRPC channel.

    Security (all off by default; checked, and files read, here -- see ``_credentials.py``):
    ``tls_ca`` (the CA bundle the server's certificate must chain to; TLS on, else the system's
    CAs with ``grpcs://``), ``tls_cert`` + ``tls_key`` (a client certificate, for servers that
    require one), ``server_name`` (the name to expect in the server's certificate, when not the
    url's host) -- each a file path or PEM bytes -- and ``token`` (sent with every call as
    ``authorization: Bearer <token>``)."""

    def _open(self) -> None:
        self._channel: grpc.Channel = self._open_channel(grpc)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """Generate a completion and wait for all of it.

        ``prompt``: text (tokenized by the server) or token ids. The generation options
        (``max_new_tokens``, ``speculation``, ``temperature``, ``seed``, ...) are keyword
        arguments, or a ``GenerateOptions`` whose fields the keywords override; ``GenerateOptions``
        documents each one. ``timeout`` overrides the client's default deadline for this call.
        Options are checked before anything is sent (``ValueError``/``TypeError``).
        """
        return self._unary(GENERATE, build_generate_request(prompt, options, **overrides), timeout)

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> ResponseStream:
        """Like ``generate`` but yields ``StreamChunk`` deltas (each with the logprobs of its own
        tokens, when asked for); the last one carries finish_reason, usage, stats, timings and
        seed. Arguments are checked now; the RPC starts on first iteration."""
        return self._stream(build_generate_request(prompt, options, **overrides), timeout)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """The assistant's reply to a conversation: ``messages`` is a list of ``{"role", "content"}``
        mappings (roles "system", "user", "assistant", "tool"; an assistant's may carry its earlier
        ``tool_calls``), rendered by the server with the model's chat template; generation stops
        at the template's end-of-turn token. Options and ``timeout`` as in ``generate``. A model
        without a chat template answers InvalidArgument."""
        return self._unary(GENERATE, build_chat_request(messages, options, **overrides), timeout)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> ResponseStream:
        """``chat`` as a stream of ``StreamChunk`` deltas (see ``generate_stream``)."""
        return self._stream(build_chat_request(messages, options, **overrides), timeout)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._unary(GET_MODEL_INFO, generation_pb2.GetModelInfoRequest(), timeout)

    def _unary(self, rpc: Rpc[R], request: Message, timeout: float | None) -> R:
        call = self._call(rpc, request, timeout)
        with map_rpc_errors():
            response = call.start(self._stub)
        return call.parse(response)

    def _stream(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> ResponseStream:
        return ResponseStream(self._stub, request, self._deadline(timeout), self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
