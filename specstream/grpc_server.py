"""Builds the grpc.aio servers of all three services the same way.

Each server gets: the configured message-size and keepalive options, `grpc.health.v1` (NOT_SERVING
until the service says it is ready), server reflection when `reflection` is on, `ErrorInterceptor`,
the one place where exceptions become gRPC status codes, and, when `metrics_port` is set, the
service's Prometheus registry on HTTP `/metrics` (from `start()` until the end of `serve_forever`).
With `security` (design §10b): TLS or mTLS on its port (specstream/tls.py), `AuthInterceptor` in
front of every method but health (specstream/auth.py), and SIGHUP reloading the certificate, key,
client CA and token files for new handshakes and calls. Knows nothing about models or requests.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specstream.auth import AuthInterceptor, TokenSet
from specstream.config import ServerConfig
from specstream.errors import SpecstreamError
from specstream.metrics import MetricsServer, start_metrics_server
from specstream.rpc_handlers import rewrap
from specstream.tls import ServerCertificates

log = logging.getLogger(__name__)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SpecstreamError to its status code; anything else unexpected to INTERNAL (logged)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):
            return handler
        method = handler_call_details.method
        return rewrap(handler, lambda behavior: _wrap_unary(behavior, method),
                      lambda behavior: _wrap_stream(behavior, method))


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, SpecstreamError):
        await context.abort(exc.code, str(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a status, never swallowed
            await _abort_for(exc, context, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext):
        try:
            async for item in behavior(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a status, never swallowed
            await _abort_for(exc, context, method)

    return wrapped


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
        for name in ["", *self.service_names]:
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
