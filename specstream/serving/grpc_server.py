"""Builds the grpc.aio servers of all three services the same way.

Each server gets: the configured message-size and keepalive options, `grpc.health.v1` (NOT_SERVING
until the service says it is ready), server reflection when `reflection` is on, `ErrorInterceptor`,
the one place where exceptions become gRPC status codes, and, when `metrics_port` is set, the
service's Prometheus registry on HTTP `/metrics` (from `start()` until the end of `serve_forever`).
With `security` (docs/architecture.md §9.1): TLS or mTLS on its port (specstream/serving/tls.py), `AuthInterceptor` in
front of every method but health (specstream/serving/auth.py), and SIGHUP reloading the certificate, key,
client CA and token files for new handshakes and calls. Knows nothing about models or requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specstream.data.config import ServerConfig
from specstream.data.errors import SpecstreamError
from specstream.serving.auth import AuthInterceptor, TokenSet
from specstream.serving.metrics import MetricsServer, start_metrics_server
from specstream.serving.rpc_handlers import rewrap
from specstream.serving.tls import ServerCertificates

log = logging.getLogger(__name__)


class Undecodable:
    """What a request's bytes became when they are not the method's message: the handler answers
    INVALID_ARGUMENT instead of grpc's UNKNOWN (and its logged traceback) for a caller's bytes."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def abort(self, context: grpc.aio.ServicerContext, method: str) -> Awaitable[None]:
        return context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"request: the bytes are not a valid {method.rsplit('/', 1)[-1]} request message "
                             f"({self.reason})")


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - a caller's bytes: answered as INVALID_ARGUMENT
            return Undecodable(str(exc).split(":")[-1].strip() or type(exc).__name__)

    return parse


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SpecstreamError to its status code, undecodable request bytes to INVALID_ARGUMENT;
    anything else unexpected to INTERNAL (logged)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):
            return handler
        method, streaming = handler_call_details.method, handler.request_streaming
        return rewrap(handler, lambda behavior: _wrap_unary(behavior, method, streaming),
                      lambda behavior: _wrap_stream(behavior, method, streaming),
                      request_deserializer=_tolerant(handler.request_deserializer))


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, SpecstreamError):
        await context.abort(exc.code, str(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str):
    async for request in requests:
        if isinstance(request, Undecodable):
            await request.abort(context, method)
        yield request


def _decoded(request: Any, context: grpc.aio.ServicerContext, method: str, streaming: bool) -> Any:
    """The request (a checked iterator for a client stream); aborts when the bytes did not parse."""
    return _checked(request, context, method) if streaming else request


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str, streaming: bool):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Undecodable):
                await request.abort(context, method)
            return await behavior(_decoded(request, context, method, streaming), context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a status, never swallowed
            await _abort_for(exc, context, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str, streaming: bool):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext):
        try:
            if isinstance(request, Undecodable):
                await request.abort(context, method)
            async for item in behavior(_decoded(request, context, method, streaming), context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a status, never swallowed
            await _abort_for(exc, context, method)

    return wrapped


def process_health_name(pid: int) -> str:
    """The health service name a server also answers under: its process id. Whoever started the
    process asks for that name, so another program that took the port in between (its own server
    answers "" as SERVING too) is never mistaken for it: it answers NOT_FOUND."""
    return f"specstream.process.{pid}"


class ServiceServer:
    """A grpc.aio server with health (+ reflection) and a /metrics endpoint for `registry`, secured
    as `config.security` says; `serve_forever` stops cleanly on SIGTERM/SIGINT. `certificates` and
    `tokens` (None when off) are for the gateway's HTTP front to share, so one SIGHUP reloads both."""

    def __init__(self, config: ServerConfig, service_names: Iterable[str], registry: CollectorRegistry) -> None:
        self.config = config
        self.registry = registry
        self.metrics: MetricsServer | None = None
        security = config.security
        self.certificates = ServerCertificates(security) if security.tls else None
        self.tokens = TokenSet(security.token_file) if security.token_file else None
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
        if self.tokens is not None or security.allowed_peers:
            interceptors.insert(0, AuthInterceptor(self.tokens, security.allowed_peers))  # refusals go first
        self.server = grpc.aio.server(options=config.grpc_options(), interceptors=interceptors)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        if config.reflection:
            reflection.enable_server_reflection([*self.service_names, reflection.SERVICE_NAME,
                                                 health.SERVICE_NAME], self.server)
        address = f"{config.host}:{config.port}"
        self.port = self.server.add_secure_port(address, self.certificates.grpc_credentials()) \
            if self.certificates is not None else self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")

    def reload(self) -> None:
        """SIGHUP: the certificate, key, client CA and token files again, for new handshakes and
        calls; a file that cannot be used is logged and the previous one kept."""
        log.info("SIGHUP: reloading security files")
        if self.certificates is not None:
            self.certificates.reload()
        if self.tokens is not None:
            self.tokens.reload()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names, process_health_name(os.getpid())]:
            await _maybe_await(self.health.set(name, status))

    async def start(self) -> None:
        await self.set_serving(False)
        if self.config.security.enabled:  # otherwise SIGHUP keeps its default (ends the process)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        await self.server.start()
        if self.config.metrics_port is not None:
            self.metrics = start_metrics_server(self.registry, self.config.host, self.config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics.port)

    async def serve_forever(self, on_stop: Callable[[], Awaitable[None]] | None = None,
                            stop_beside: Callable[[], Awaitable[None]] | None = None) -> None:
        """Runs until SIGTERM/SIGINT; then NOT_SERVING, a graceful stop (new RPCs refused, running
        ones get `grace_s` to finish) alongside `stop_beside` (another front's own graceful stop),
        and last `on_stop` to release what they were using."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping %s", self.address)
        await self.set_serving(False)
        await asyncio.gather(self.server.stop(self.config.grace_s), *([stop_beside()] if stop_beside else []))
        if on_stop is not None:
            await on_stop()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)


async def _maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value):
        await value
