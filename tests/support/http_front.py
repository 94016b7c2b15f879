"""The HTTP front's test harness: the real gateway (`Gateway` core, `Router`, a `TargetClient` on
its `Connect` stream) in front of a scripted target on a loopback port, the real HTTP server
(uvicorn on the test's event loop) and the official `openai` client; `raw_http` for the bytes a
client would not send. Used by tests/test_http_front.py and tests/test_http_front_security.py."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import openai

from gateway.http.app import build_app
from gateway.http.server import HttpServer
from gateway.router import Router
from gateway.service import Gateway
from gateway.target_client import TargetClient
from specstream.data.config import GatewayConfig
from specstream.serving.auth import TokenSet
from specstream.serving.metrics import GatewayMetrics
from specstream.serving.tls import ServerCertificates
from specstream_pb import target_pb2_grpc
from tests.support.scripted_target import MODEL, TT, StreamingTarget


@dataclass
class Front:
    target: StreamingTarget
    gateway: Gateway
    url: str  # http://127.0.0.1:port
    client: openai.AsyncOpenAI
    target_server: grpc.aio.Server


@asynccontextmanager
async def served(max_in_flight: int = 8, max_body_bytes: int = 1 << 20,
                 ready=None, tokens: TokenSet | None = None, certificates: ServerCertificates | None = None,
                 client_context: ssl.SSLContext | None = None) -> AsyncIterator[Front]:
    """`tokens`/`certificates`: the front asks for a bearer token / serves HTTPS; `client_context`:
    how the openai client connects then (its CA, its certificate)."""
    target = StreamingTarget()
    target_server = grpc.aio.server()
    target_pb2_grpc.add_TargetServicer_to_server(target, target_server)
    port = target_server.add_insecure_port("127.0.0.1:0")
    await target_server.start()
    replica = TargetClient(f"127.0.0.1:{port}", retry_s=0.1)
    await replica.start(timeout_s=10)
    metrics = GatewayMetrics()
    gateway = Gateway(GatewayConfig(replica.url, MODEL, max_in_flight=max_in_flight), Router([replica], max_queue=8),
                      replica.info, TT, metrics)
    http = HttpServer(build_app(gateway, metrics.registry, ready=ready, max_body_bytes=max_body_bytes, tokens=tokens),
                      "127.0.0.1", 0, grace_s=1.0, certificates=certificates)
    await http.start()
    for _ in range(500):
        if replica.routable:
            break
        await asyncio.sleep(0.01)
    scheme = "https" if certificates else "http"
    tls = {"http_client": openai.DefaultAsyncHttpxClient(verify=client_context)} if client_context else {}
    client = openai.AsyncOpenAI(base_url=f"{scheme}://{http.address}/v1", api_key="none", max_retries=0, timeout=30,
                                **tls)
    try:
        yield Front(target, gateway, f"{scheme}://{http.address}", client, target_server)
    finally:
        await client.close()
        await http.stop()
        await replica.close()
        await target_server.stop(None)


async def raw_http(url: str, path: str, body: bytes | None, method: str = "POST",
               headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on a fresh connection: (status, headers, body); over TLS with `tls`."""
    host, port = url.partition("://")[2].split(":")
    reader, writer = await asyncio.open_connection(host, int(port), ssl=tls)
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    data = await reader.read()
    writer.close()
    header, _, payload = data.partition(b"\r\n\r\n")
    lines = header.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        payload = _unchunk(payload)
    return int(lines[0].split()[1]), headers, payload


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def run(coro):
    return asyncio.run(coro)
