"""Channels from our services and tools to our servers, as a `ChannelSecurity` says: TLS against its
CA bundle (with its client certificate for mTLS, and the name to expect), and its internal token
on every call.

Without a ChannelSecurity, or one that sets nothing, a plain channel as before. The token travels
as `authorization: Bearer <token>` metadata added by client interceptors, so it also goes over a
plaintext channel (grpc's call credentials refuse those): there anyone on the path can read it,
so use a token without TLS only over loopback (a colocated draft) or a network you trust.

What it does not know: what is called on the channel, and reconnection (grpc's).
"""

from __future__ import annotations

from typing import Any

import grpc

from specstream.data.config import ChannelSecurity
from specstream.serving import tls
from specstream.serving.auth import read_tokens

Options = list[tuple[str, Any]]


def _parts(security: ChannelSecurity | None, options: Options | None) -> tuple[Options, grpc.ChannelCredentials | None,
                                                                                str | None]:
    """(options, TLS credentials or None, token or None); files are read here, once."""
    options = [*(options or []), *tls.channel_options(security)]
    if security is None:
        return options, None, None
    credentials = tls.channel_credentials(security) if security.tls else None
    token = read_tokens(security.token_file)[0] if security.token_file else None
    return options, credentials, token


def open_channel(url: str, options: Options | None = None, security: ChannelSecurity | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `url` (create it inside the event loop that will use it)."""
    options, credentials, token = _parts(security, options)
    interceptors = _aio_token_interceptors(token) if token else None
    if credentials is None:
        return grpc.aio.insecure_channel(url, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(url, credentials, options=options, interceptors=interceptors)


def open_blocking_channel(url: str, options: Options | None = None,
                          security: ChannelSecurity | None = None) -> grpc.Channel:
    """A synchronous channel to `url` (the launcher's health polling, benchmarks' counters)."""
    options, credentials, token = _parts(security, options)
    channel = grpc.insecure_channel(url, options=options) if credentials is None \
        else grpc.secure_channel(url, credentials, options=options)
    return grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel


class _AddToken:
    """Adds `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.header])

    def aio_details(self, details):
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), self.header))


class _AioUnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.aio_details(client_call_details), request)


class _AioUnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.aio_details(client_call_details), request)


class _AioStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self.aio_details(client_call_details), request_iterator)


class _AioStreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self.aio_details(client_call_details), request_iterator)


def _aio_token_interceptors(token: str) -> list:
    # grpc.aio files an interceptor under the first call kind it implements, so one per kind.
    return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _TokenInterceptor(_AddToken, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self.details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self.details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self.details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self.details(client_call_details), request_iterator)
