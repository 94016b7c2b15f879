"""Synchronous client for the specstream gateway (the ``specstream.v1.Generation`` service).

Contract: one ``Client`` owns one gRPC channel (thread-safe; share it between threads). Every
failed RPC -- including one that fails after a stream has yielded chunks -- raises a
``SpecstreamError`` subclass chosen by status code. A stream that is closed, garbage-collected or
abandoned by ``break`` cancels its RPC, which lets the server free the sequence.

What it does not know: retries (none are made: a failed ``Generate`` may have run on the server),
load balancing across gateways, and server limits (see ``model_info()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from specstream_pb import generation_pb2, generation_pb2_grpc

from ._credentials import Credentials, PemSource
from ._request import build_chat_request, build_generate_request, parse_target, resolve_timeout
from .errors import from_rpc_error
from .options import GenerateOptions
from .types import GenerateResult, ModelInfo, StreamChunk

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import GenerateOptionsDict

__all__ = ["Client", "ResponseStream"]


class ResponseStream(Iterator[StreamChunk]):
    """Iterator over one ``GenerateStream`` call. The RPC starts on the first ``next()``;
    ``close()``/``cancel()`` (or leaving a ``with`` block) cancels it if still running."""

    def __init__(
        self,
        stub: generation_pb2_grpc.GenerationStub,
        request: generation_pb2.GenerateRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._stub = stub
        self._request = request
        self._timeout = timeout
        self._metadata = metadata
        self._call: Any = None  # grpc's stream call object: iterator + grpc.Call
        self._done = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        if self._call is None:
            self._call = self._stub.GenerateStream(self._request, timeout=self._timeout, metadata=self._metadata)
        try:
            msg = next(self._call)
        except StopIteration:
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

    close = cancel

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        # Abandoned mid-stream (e.g. `break` out of a for loop): free the server's sequence now
        # rather than at the deadline.
        try:
            self.cancel()
        except Exception:
            pass


class Client:
    """Blocking client. ``url`` is ``"host:port"`` or ``"grpc://host:port"`` (``"grpcs://"`` uses
    TLS). ``timeout`` is the default per-call deadline in seconds (None: no deadline); ``options``
    are passed to the gRPC channel.

    Security (all off by default; checked, and files read, here -- see ``_credentials.py``):
    ``tls_ca`` (the CA bundle the server's certificate must chain to; TLS on, else the system's
    CAs with ``grpcs://``), ``tls_cert`` + ``tls_key`` (a client certificate, for servers that
    require one), ``server_name`` (the name to expect in the server's certificate, when not the
    url's host) -- each a file path or PEM bytes -- and ``token`` (sent with every call as
    ``authorization: Bearer <token>``)."""

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
        credentials = Credentials.from_options(scheme, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                               server_name=server_name, token=token)
        self._metadata = credentials.metadata
        opts = [*options, *credentials.channel_options()]
        channel_credentials = credentials.channel_credentials()
        if channel_credentials is not None:
            self._channel = grpc.secure_channel(target, channel_credentials, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
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
        request = build_generate_request(prompt, options, **overrides)
        try:
            response = self._stub.Generate(request, timeout=resolve_timeout(timeout, self.timeout),
                                           metadata=self._metadata)
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
    ) -> ResponseStream:
        """Like ``generate`` but yields ``StreamChunk`` deltas (each with the logprobs of its own
        tokens, when asked for); the last one carries finish_reason, usage, stats, timings and
        seed. Arguments are checked now; the RPC starts on first iteration."""
        request = build_generate_request(prompt, options, **overrides)
        return ResponseStream(self._stub, request, resolve_timeout(timeout, self.timeout), self._metadata)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        options: GenerateOptions | None = None,
        *,
        timeout: float | None = None,
        **overrides: Unpack[GenerateOptionsDict],
    ) -> GenerateResult:
        """The assistant's reply to a conversation: ``messages`` is a list of ``{"role", "content"}``
        mappings (roles "system", "user", "assistant"), rendered by the server with the model's
        chat template; generation stops at the template's end-of-turn token. Options and
        ``timeout`` as in ``generate``. A model without a chat template answers InvalidArgument."""
        request = build_chat_request(messages, options, **overrides)
        try:
            response = self._stub.Generate(request, timeout=resolve_timeout(timeout, self.timeout),
                                           metadata=self._metadata)
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
    ) -> ResponseStream:
        """``chat`` as a stream of ``StreamChunk`` deltas (see ``generate_stream``)."""
        request = build_chat_request(messages, options, **overrides)
        return ResponseStream(self._stub, request, resolve_timeout(timeout, self.timeout), self._metadata)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            response = self._stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=resolve_timeout(timeout, self.timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        return ModelInfo.from_pb(response)

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
