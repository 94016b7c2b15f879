"""uvicorn, embedded in the gateway's running event loop (uvloop), serving the HTTP app; over
HTTPS when given the gateway's `ServerCertificates` (the same certificate, client CA and SIGHUP
reloads as its gRPC port: specstream/serving/tls.py).

The socket is bound here, before uvicorn starts, so port 0 gets a free port that `port` reports
at once. uvicorn's own signal handling is turned off: the gateway's `serve_forever` owns SIGTERM
and stops this server alongside the gRPC one (`stop`: no new connections, running requests get
`grace_s`, then they are cancelled, which cancels them on the target).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from specstream.serving.tls import ServerCertificates

log = logging.getLogger(__name__)


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the gateway's handlers stop us (see `stop`)
        yield


class HttpServer:
    def __init__(self, app, host: str, port: int, grace_s: float,
                 certificates: ServerCertificates | None = None) -> None:
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         reuse_port=False)
        self.sock.setblocking(False)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        tls = {"ssl_context_factory": lambda config, default: certificates.ssl_context()} if certificates else {}
        config = uvicorn.Config(app, loop="none", lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace_s, timeout_keep_alive=30, **tls)
        self.scheme = "https" if certificates else "http"
        self.server = _Embedded(config)
        self.task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="http-front")
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it could not start
                raise RuntimeError(f"HTTP server on {self.address} stopped during startup")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on %s://%s/v1", self.scheme, self.address)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        await self.task
