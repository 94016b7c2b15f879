"""The security matrix of one gRPC server, every refusal driven: TLS, mTLS, the peer allow-list,
bearer tokens, reflection, and reloading the files (reload() and SIGHUP).

The server is the real `ServiceServer` (specstream/serving/grpc_server.py) on a loopback port, serving a
scripted `Generation` service (one unary and one streaming method); clients open their channels
with the product's own helper (specstream/serving/channels.py) or plain grpc where a client would not use
it. Certificates come from the `pki` fixture (two throwaway CAs). The three real processes with
every hop secured: tests/integration/test_secure_stack.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from specstream.data.config import ChannelSecurity, ServerConfig, ServerSecurity
from specstream.data.errors import PermissionDeniedError, UnauthenticatedError
from specstream.serving.auth import TokenSet, read_tokens
from specstream.serving.channels import open_blocking_channel, open_channel
from specstream.serving.grpc_server import ServiceServer
from tests.support.pki import serial_of
from specstream_pb import generation_pb2, generation_pb2_grpc

SERVICE = "specstream.v1.Generation"
OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


class Scripted(generation_pb2_grpc.GenerationServicer):
    async def GetModelInfo(self, request, context):  # noqa: N802
        return generation_pb2.ModelInfo(target_model="scripted")

    async def GenerateStream(self, request, context):  # noqa: N802
        yield generation_pb2.GenerateStreamResponse(text="hi")


@asynccontextmanager
async def serving(security: ServerSecurity | None = None, reflection: bool = False) -> AsyncIterator[ServiceServer]:
    config = ServerConfig(port=0, security=security or ServerSecurity(), reflection=reflection)
    server = ServiceServer(config, [SERVICE], CollectorRegistry())
    generation_pb2_grpc.add_GenerationServicer_to_server(Scripted(), server.server)
    await server.start()
    await server.set_serving(True)
    try:
        yield server
    finally:
        await server.server.stop(None)


async def call(address: str, security: ChannelSecurity | None = None, metadata=None,
               channel: grpc.aio.Channel | None = None) -> grpc.StatusCode:
    """GetModelInfo's status code (OK when served)."""
    own = channel is None
    channel = channel or open_channel(address, security=security)
    try:
        await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                       timeout=5, metadata=metadata)
        return OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        if own:
            await channel.close()


async def stream(address: str, security: ChannelSecurity | None = None, metadata=None) -> grpc.StatusCode:
    """GenerateStream's status code (OK when its chunk arrived)."""
    async with open_channel(address, security=security) as channel:
        try:
            chunks = [c async for c in generation_pb2_grpc.GenerationStub(channel).GenerateStream(
                generation_pb2.GenerateRequest(prompt="x"), timeout=5, metadata=metadata)]
            assert [c.text for c in chunks] == ["hi"]
            return OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def health(address: str, security: ChannelSecurity | None = None) -> grpc.StatusCode:
    async with open_channel(address, security=security) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            return OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def list_services(address: str, security: ChannelSecurity | None = None, metadata=None,
                        ask: bool = True) -> set[str]:
    """Reflection's service list; raises AioRpcError when refused or not served. Waits for the
    connection (within the timeout): a server just started on a port another test's server just
    left can meet a connection that gRPC's process-wide subchannel pool saw refused, which a
    fail-fast call would report as UNAVAILABLE. `ask=False` opens the stream without a request:
    a refusal at the call's start then cannot race the client's write of its request (which gRPC
    reports as INTERNAL, "Failed execute_batch", once in a few hundred runs)."""
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")] if ask else []
    async with open_channel(address, security=security) as channel:
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(requests), timeout=5, metadata=metadata, wait_for_ready=True)
        async for reply in responses:
            return {s.name for s in reply.list_services_response.service}
    raise AssertionError("no reflection reply")


def served_serial(port: int) -> int:
    """The serial of the certificate the server presents to a new connection (not verified: this
    looks, it does not trust)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    # TLS 1.3: the server shows its certificate before it asks for the client's.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, context.wrap_socket(sock) as tls:
        return serial_of(tls.getpeercert(binary_form=True))


def run(coro):
    return asyncio.run(coro)


def tls_server(pki, mtls: bool = False, **kwargs) -> ServerSecurity:
    return ServerSecurity(cert_file=pki.path("gateway.crt"), key_file=pki.path("gateway.key"),
                          client_ca_file=pki.path("ca.crt") if mtls else None, **kwargs)


def client(pki, role: str | None = "client", other_ca: bool = False, ca: str = "ca.crt",
           token_file: str | None = None) -> ChannelSecurity:
    """A client trusting `ca` (of the first CA) with `role`'s certificate (None: none), from the
    other CA's files with `other_ca`."""
    path = pki.other_path if other_ca else pki.path
    return ChannelSecurity(label="test", ca_file=pki.path(ca), cert_file=path(f"{role}.crt") if role else None,
                           key_file=path(f"{role}.key") if role else None, token_file=token_file)


# ---- TLS -----------------------------------------------------------------------------------------


def test_a_plaintext_client_cannot_reach_a_tls_server(pki) -> None:
    async def go():
        async with serving(tls_server(pki)) as server:
            assert await call(server.address) == UNAVAILABLE
            assert await health(server.address) == UNAVAILABLE  # not even health: TLS comes first
            assert await call(server.address, client(pki, role=None)) == OK

    run(go())


def test_a_tls_client_that_trusts_another_ca_refuses_the_server(pki) -> None:
    async def go():
        async with serving(tls_server(pki)) as server:
            other = ChannelSecurity(label="test", ca_file=pki.other_path("ca.crt"))
            assert await call(server.address, other) == UNAVAILABLE
            assert await call(server.address, client(pki, role=None)) == OK

    run(go())


def test_the_name_checked_is_the_server_name_when_given(pki) -> None:
    # The gateway reaches targets by pod IP: --target-server-name names the certificate instead.
    async def go():
        async with serving(tls_server(pki)) as server:
            named = ChannelSecurity(label="test", ca_file=pki.path("ca.crt"), server_name="specstream-gateway")
            wrong = ChannelSecurity(label="test", ca_file=pki.path("ca.crt"), server_name="specstream-draft")
            assert await call(server.address, named) == OK
            assert await call(server.address, wrong) == UNAVAILABLE

    run(go())


def test_mtls_refuses_a_client_without_a_certificate(pki) -> None:
    async def go():
        async with serving(tls_server(pki, mtls=True)) as server:
            assert await call(server.address, client(pki, role=None)) == UNAVAILABLE
            assert await health(server.address, client(pki, role=None)) == UNAVAILABLE
            assert await call(server.address) == UNAVAILABLE  # nor plaintext
            assert await call(server.address, client(pki)) == OK

    run(go())


def test_mtls_refuses_a_client_certificate_from_another_ca(pki) -> None:
    async def go():
        async with serving(tls_server(pki, mtls=True)) as server:
            assert await call(server.address, client(pki, other_ca=True)) == UNAVAILABLE
            assert await call(server.address, client(pki)) == OK

    run(go())


def test_the_allow_list_refuses_other_names_from_the_same_ca_but_not_health(pki) -> None:
    # A target accepts the gateway's certificate only: a client certificate from the same CA (a
    # public client's) is refused with PERMISSION_DENIED, on every method, reflection included.
    async def go():
        security = tls_server(pki, mtls=True, allowed_peers=("specstream-target",))
        async with serving(security, reflection=True) as server:
            assert await call(server.address, client(pki, role="client")) == PERMISSION_DENIED
            assert await stream(server.address, client(pki, role="client")) == PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await list_services(server.address, client(pki, role="client"), ask=False)
            assert refused.value.code() == PERMISSION_DENIED
            assert await health(server.address, client(pki, role="client")) == OK  # probes
            assert await call(server.address, client(pki, role="target")) == OK
            assert await stream(server.address, client(pki, role="target")) == OK

    run(go())


# ---- tokens --------------------------------------------------------------------------------------


def test_tokens_no_token_wrong_token_right_token(pki, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# the API's tokens\n\n  first-token  \nsecond-token\n")

    async def go():
        async with serving(ServerSecurity(token_file=str(tokens))) as server:
            address = server.address
            for method in (call, stream):
                assert await method(address) == UNAUTHENTICATED
                assert await method(address, metadata=(("authorization", "Basic Zm9vOmJhcg=="),)) == UNAUTHENTICATED
                assert await method(address, metadata=(("authorization", "Bearer "),)) == UNAUTHENTICATED
                assert await method(address, metadata=(("authorization", "Bearer first-token-x"),)) \
                    == PERMISSION_DENIED
                assert await method(address, metadata=(("authorization", "Bearer first"),)) == PERMISSION_DENIED
                assert await method(address, metadata=(("authorization", "Bearer first-token"),)) == OK
                assert await method(address, metadata=(("authorization", "bearer second-token"),)) == OK
            assert await health(address) == OK  # probes send no token

    run(go())


def test_a_channel_with_a_token_file_sends_its_first_token_on_every_kind_of_call(tmp_path: Path) -> None:
    # The internal token without TLS (mTLS off): the gateway -> target and target -> draft hops
    # open their channels with specstream.serving.channels, whose interceptors add the token to unary
    # and streaming calls, read/write style (the draft client's) and iterator style alike.
    tokens = tmp_path / "tokens"
    tokens.write_text("internal-1\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("# rotated out\ninternal-0\n")

    async def go():
        async with serving(ServerSecurity(token_file=str(tokens)), reflection=True) as server:
            sends = ChannelSecurity(label="test", token_file=str(tokens))
            assert await call(server.address, sends) == OK
            assert await stream(server.address, sends) == OK
            assert SERVICE in await list_services(server.address, sends)
            async with open_channel(server.address, security=sends) as channel:  # read/write style
                bidi = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
                await bidi.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                assert SERVICE in {s.name for s in (await bidi.read()).list_services_response.service}
                await bidi.done_writing()
            assert await call(server.address, ChannelSecurity(label="test", token_file=str(wrong))) \
                == PERMISSION_DENIED
            assert await call(server.address) == UNAUTHENTICATED
            with open_blocking_channel(server.address, security=sends) as channel:  # the launcher's, the benches'
                stub = generation_pb2_grpc.GenerationStub(channel)
                assert (await asyncio.to_thread(stub.GetModelInfo, generation_pb2.GetModelInfoRequest(),
                                                timeout=5)).target_model == "scripted"

    run(go())


def test_mtls_and_tokens_together(pki) -> None:
    async def go():
        security = tls_server(pki, mtls=True, allowed_peers=("specstream-gateway",),
                              token_file=pki.path("internal-token"))
        async with serving(security) as server:
            right = client(pki, role="gateway", token_file=pki.path("internal-token"))
            assert await call(server.address, client(pki, role="gateway")) == UNAUTHENTICATED
            assert await call(server.address, client(pki, role="gateway", token_file=pki.path("api-tokens"))) \
                == PERMISSION_DENIED
            assert await call(server.address, client(pki, role="client", token_file=pki.path("internal-token"))) \
                == PERMISSION_DENIED
            assert await call(server.address, right) == OK

    run(go())


def test_token_files_are_read_strictly_and_never_quoted(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\n\n  alpha  \n\tbeta\n# another\n")
    assert read_tokens(str(path)) == ["alpha", "beta"]
    path.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match=r"token_file=.*tokens': must hold at least one token"):
        read_tokens(str(path))
    path.write_text("good\nsecret with-a-space\n")
    with pytest.raises(ValueError, match="line 2 must be one token") as bad:
        read_tokens(str(path))
    assert "secret" not in str(bad.value)
    with pytest.raises(ValueError, match="cannot be read"):
        read_tokens(str(tmp_path / "missing"))
    path.write_text("s3cret\n")
    tokens = TokenSet(str(path))
    with pytest.raises(PermissionDeniedError) as wrong:
        tokens.check("Bearer s3cret-guess")
    assert "s3cret" not in str(wrong.value)
    with pytest.raises(UnauthenticatedError):
        tokens.check(None)
    tokens.check("Bearer s3cret")


# ---- reflection ----------------------------------------------------------------------------------


def test_reflection_is_off_unless_asked_for() -> None:
    async def go():
        async with serving() as server:
            with pytest.raises(grpc.aio.AioRpcError) as off:
                await list_services(server.address, ask=False)
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with serving(reflection=True) as server:
            assert {SERVICE, "grpc.health.v1.Health"} <= await list_services(server.address)

    run(go())


def test_reflection_needs_the_token_like_every_method_but_health(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t0k3n\n")

    async def go():
        async with serving(ServerSecurity(token_file=str(tokens)), reflection=True) as server:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await list_services(server.address, ask=False)
            assert refused.value.code() == UNAUTHENTICATED
            assert SERVICE in await list_services(server.address, metadata=(("authorization", "Bearer t0k3n"),))

    run(go())


# ---- reloading -----------------------------------------------------------------------------------


def _install(pki, tmp_path: Path, stem: str, serial: int) -> ServerSecurity:
    """The server's files at fixed paths, holding a new certificate with `serial`."""
    cert, key = pki.issue_files(stem, "specstream-gateway", serial=serial)
    shutil.copy(cert, tmp_path / "server.crt")
    shutil.copy(key, tmp_path / "server.key")
    return ServerSecurity(cert_file=str(tmp_path / "server.crt"), key_file=str(tmp_path / "server.key"))


def test_reload_serves_the_new_certificate_to_new_connections_only(pki, tmp_path: Path) -> None:
    async def go():
        security = _install(pki, tmp_path, "first", serial=1001)
        async with serving(security) as server:
            assert await asyncio.to_thread(served_serial, server.port) == 1001
            old = open_channel(server.address, security=client(pki, role=None))
            assert await call(server.address, channel=old) == OK
            _install(pki, tmp_path, "second", serial=1002)
            assert await asyncio.to_thread(served_serial, server.port) == 1001  # files alone change nothing
            assert server.certificates.reload()
            assert await asyncio.to_thread(served_serial, server.port) == 1002
            assert await call(server.address, client(pki, role=None)) == OK
            assert await call(server.address, channel=old) == OK  # an open connection keeps going
            await old.close()
            # A broken file is refused and the last good one stays in use.
            (tmp_path / "server.key").write_text("not a key\n")
            assert not server.certificates.reload()
            assert await asyncio.to_thread(served_serial, server.port) == 1002
            (tmp_path / "server.crt").write_bytes(Path(pki.path("target.crt")).read_bytes())  # key mismatch
            shutil.copy(pki.path("gateway.key"), tmp_path / "server.key")
            assert not server.certificates.reload()
            assert await call(server.address, client(pki, role=None)) == OK

    run(go())


def test_sighup_reloads_certificate_client_ca_and_tokens(pki, tmp_path: Path) -> None:
    # A real SIGHUP to this process: the server's handler (installed on its event loop) rereads
    # the certificate, the client CA bundle and the token file.
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token\n")
    client_ca = tmp_path / "client-ca.crt"
    shutil.copy(pki.path("ca.crt"), client_ca)

    async def until(check, what: str) -> None:
        for _ in range(200):
            if await check():
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"after SIGHUP: {what}")

    async def go():
        security = _install(pki, tmp_path, "before-hup", serial=2001)
        security = ServerSecurity(cert_file=security.cert_file, key_file=security.key_file,
                                  client_ca_file=str(client_ca), token_file=str(tokens))
        ours = client(pki, token_file=str(tokens))
        theirs = client(pki, other_ca=True, token_file=str(tokens))
        async with serving(security) as server:
            assert await call(server.address, ours) == OK
            assert await call(server.address, theirs) == UNAVAILABLE
            _install(pki, tmp_path, "after-hup", serial=2002)
            shutil.copy(pki.other_path("ca.crt"), client_ca)  # now only the other CA's clients
            tokens.write_text("new-token\n")
            old_token_file, new_token_file = tmp_path / "client-old-token", tmp_path / "client-new-token"
            old_token_file.write_text("old-token\n")
            new_token_file.write_text("new-token\n")
            os.kill(os.getpid(), signal.SIGHUP)
            await until(lambda: asyncio.to_thread(lambda: served_serial(server.port) == 2002), "the new certificate")
            assert await call(server.address, ours) == UNAVAILABLE  # its CA is no longer trusted
            assert await call(server.address, client(pki, other_ca=True, token_file=str(old_token_file))) \
                == PERMISSION_DENIED
            assert await call(server.address, client(pki, other_ca=True, token_file=str(new_token_file))) == OK

    run(go())


def test_a_new_token_never_starts_with_a_dash_which_a_command_line_would_read_as_a_flag(monkeypatch) -> None:
    import secrets

    from tools import certs

    drawn = iter(["-leading-dash", "_fine-token"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    assert certs.new_token() == "_fine-token"
