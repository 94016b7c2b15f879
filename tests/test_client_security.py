"""The SDK's and the CLI's security options, end to end: TLS (`tls_ca`, `--tls-ca`), a client
certificate (`tls_cert`/`tls_key`), the expected server name, and the bearer token (`token`,
`--token`, SPECSTREAM_TOKEN), against a real `ServiceServer` that requires all of them (mTLS with
an allow-list, tokens), serving a scripted Generation service; and the checks the SDK makes before
anything is sent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from specstream.data.config import ServerConfig, ServerSecurity
from specstream.serving.grpc_server import ServiceServer
from tools.cli import main
from specstream_client import AsyncClient, Client, PermissionDenied, Unauthenticated, Unavailable
from specstream_client._credentials import Credentials
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc


class Scripted(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):  # noqa: N802
        return generation_pb2.GenerateResponse(text=f"echo {request.prompt}",
                                               finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def GenerateStream(self, request, context):  # noqa: N802
        for word in ("echo ", request.prompt):
            yield generation_pb2.GenerateStreamResponse(text=word)

    async def GetModelInfo(self, request, context):  # noqa: N802
        return generation_pb2.ModelInfo(target_model="scripted")


@pytest.fixture(scope="module")
def gateway(pki) -> Iterator[str]:
    """A server on its own thread and loop wanting a certificate from the pki's CA naming
    specstream-client, and a token of api-tokens; yields its address."""
    security = ServerSecurity(cert_file=pki.path("gateway.crt"), key_file=pki.path("gateway.key"),
                              client_ca_file=pki.path("ca.crt"), allowed_peers=("specstream-client",),
                              token_file=pki.path("api-tokens"))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, ServiceServer] = {}

    async def start() -> None:
        server = ServiceServer(ServerConfig(port=0, security=security), ["specstream.v1.Generation"],
                               CollectorRegistry())
        generation_pb2_grpc.add_GenerationServicer_to_server(Scripted(), server.server)
        await server.server.start()  # not ServiceServer.start: no SIGHUP handler off the main thread
        await server.set_serving(True)
        holder["server"] = server
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield holder["server"].address
    asyncio.run_coroutine_threadsafe(holder["server"].server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def token(pki) -> str:
    return Path(pki.path("api-tokens")).read_text().strip()


def credentials(pki, **changes) -> dict:
    options = dict(tls_ca=pki.path("ca.crt"), tls_cert=pki.path("client.crt"), tls_key=pki.path("client.key"),
                   token=token(pki))
    return {**options, **changes}


def test_the_sync_client_sends_certificate_and_token(gateway: str, pki) -> None:
    with Client(gateway, timeout=10, **credentials(pki)) as client:
        assert client.generate("hi").text == "echo hi"
        assert "".join(chunk.text for chunk in client.generate_stream("there")) == "echo there"
        assert client.chat([{"role": "user", "content": "x"}]).text == "echo "
        assert client.model_info().target_model == "scripted"
    # PEM bytes work as well as paths; the url's grpcs:// and a named server too.
    pem = {name: Path(path).read_bytes() for name, path in credentials(pki).items() if name.startswith("tls_")}
    with Client(f"grpcs://{gateway}", timeout=10, token=token(pki), server_name="specstream-gateway", **pem) as client:
        assert client.generate("bytes").text == "echo bytes"


def test_the_async_client_sends_certificate_and_token(gateway: str, pki) -> None:
    async def go() -> None:
        async with AsyncClient(gateway, timeout=10, **credentials(pki)) as client:
            assert (await client.generate("hi")).text == "echo hi"
            assert "".join([c.text async for c in client.generate_stream("you")]) == "echo you"
            assert (await client.model_info()).target_model == "scripted"
        async with AsyncClient(gateway, timeout=10, **credentials(pki, token=None)) as client:
            with pytest.raises(Unauthenticated):
                await client.generate("hi")

    asyncio.run(go())


@pytest.mark.parametrize(("changes", "error"), [
    ({"token": None}, Unauthenticated),
    ({"token": "not-the-token"}, PermissionDenied),
    # A certificate from the same CA that does not name an allowed peer.
    ({"tls_cert": "gateway.crt", "tls_key": "gateway.key"}, PermissionDenied),
    ({"tls_cert": None, "tls_key": None}, Unavailable),  # no client certificate: the handshake fails
    ({"tls_ca": "other:ca.crt"}, Unavailable),  # trusts another CA: refuses the server
    ({"tls_cert": "other:client.crt", "tls_key": "other:client.key"}, Unavailable),  # a certificate from another CA
    ({"server_name": "specstream-draft"}, Unavailable),  # the certificate does not carry that name
], ids=["no-token", "wrong-token", "not-allowed-peer", "no-client-cert", "other-ca", "other-ca-client-cert",
        "wrong-server-name"])
def test_every_refusal_surfaces_as_its_sdk_error(gateway: str, pki, changes: dict, error: type) -> None:
    def resolve(value):
        if isinstance(value, str) and value.endswith((".crt", ".key")):
            return pki.other_path(value.removeprefix("other:")) if value.startswith("other:") else pki.path(value)
        return value

    with Client(gateway, timeout=10, **credentials(pki, **{k: resolve(v) for k, v in changes.items()})) as client:
        with pytest.raises(error):
            client.generate("hi")
    with Client(gateway, timeout=10) as plaintext, pytest.raises(Unavailable):
        plaintext.generate("hi")


def test_the_cli_takes_tls_flags_and_the_token(gateway: str, pki, capsys, monkeypatch) -> None:
    flags = ["--url", gateway, "--tls-ca", pki.path("ca.crt"), "--tls-cert", pki.path("client.crt"),
             "--tls-key", pki.path("client.key")]
    assert main(["generate", "hello", *flags, "--token", token(pki)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "echo hello"
    assert main(["chat", "hello", *flags, "--stream", "--token", token(pki)]) == 0
    assert capsys.readouterr().out.startswith("echo ")
    assert main(["generate", "hello", *flags]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["generate", "hello", *flags, "--token", "wrong"]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    # The environment, read by the CLI when it parses its flags.
    monkeypatch.setenv("SPECSTREAM_TOKEN", token(pki))
    monkeypatch.setenv("SPECSTREAM_TLS_CA", pki.path("ca.crt"))
    monkeypatch.setenv("SPECSTREAM_CLIENT_CERT", pki.path("client.crt"))
    monkeypatch.setenv("SPECSTREAM_CLIENT_KEY", pki.path("client.key"))
    assert main(["generate", "from env", "--url", gateway]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "echo from env"


def test_the_cli_refuses_bad_security_options_before_sending(pki, capsys) -> None:
    assert main(["generate", "x", "--url", "grpc://127.0.0.1:1", "--tls-ca", pki.path("ca.crt")]) == 2
    assert "grpc:// is plaintext" in capsys.readouterr().err
    assert main(["generate", "x", "--url", "127.0.0.1:1", "--tls-cert", pki.path("client.crt")]) == 2
    assert "tls_cert needs tls_key" in capsys.readouterr().err


def test_health_checks_a_secured_server_as_probes_do(gateway: str, pki, capsys) -> None:
    flags = ["--url", gateway, "--tls-ca", pki.path("ca.crt")]
    client_cert = ["--tls-cert", pki.path("client.crt"), "--tls-key", pki.path("client.key")]
    assert main(["health", *flags, *client_cert]) == 0  # no token needed: health is open
    assert capsys.readouterr().out.strip() == f"{gateway}: SERVING"
    # A certificate the allow-list would refuse still gets health: a target's exec probe presents its own.
    assert main(["health", *flags, "--tls-cert", pki.path("target.crt"), "--tls-key", pki.path("target.key")]) == 0
    capsys.readouterr()
    assert main(["health", *flags, "--timeout", "3"]) == 1  # no client certificate
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main(["health", "--url", gateway, "--timeout", "3"]) == 1  # plaintext
    assert main(["health", "--url", gateway, "--tls-cert", pki.path("client.crt")]) == 2  # incomplete settings
    assert "key_file" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"tls_cert": "C"}, ValueError, "tls_cert needs tls_key"),
    ({"tls_key": "K"}, ValueError, "tls_key needs tls_cert"),
    ({"tls_ca": "/no/such/file"}, ValueError, "tls_ca='/no/such/file': cannot be read"),
    ({"tls_ca": b"not pem"}, ValueError, "tls_ca=<bytes>: must be PEM holding CA certificates"),
    ({"tls_ca": 7}, TypeError, "tls_ca must be a file path or PEM bytes, got int"),
    ({"tls_cert": "KEY", "tls_key": "KEY"}, ValueError, "tls_cert=.*: must be PEM holding a certificate"),
    ({"tls_cert": "CERT", "tls_key": "CERT"}, ValueError, "tls_key=.*: must be PEM holding a private key"),
    ({"server_name": ""}, ValueError, "server_name must be a non-empty str"),
    ({"token": "two words"}, ValueError, "token must be non-empty printable ASCII"),
    ({"token": ""}, ValueError, "token must be non-empty"),
    ({"token": b"bytes"}, TypeError, "token must be a str, got bytes"),
])
@pytest.mark.parametrize("make", [Client, AsyncClient], ids=["Client", "AsyncClient"])
def test_bad_security_options_raise_when_the_client_is_made(pki, make, kwargs: dict, error: type,
                                                            needle: str) -> None:
    files = {"C": pki.path("client.crt"), "K": pki.path("client.key"), "KEY": pki.path("client.key"),
             "CERT": pki.path("client.crt")}
    kwargs = {k: files.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=needle):
        make("127.0.0.1:1", **kwargs)


def test_tls_options_need_a_tls_url_and_the_token_is_never_shown(pki) -> None:
    with pytest.raises(ValueError, match="grpc:// is plaintext"):
        Client("grpc://127.0.0.1:1", tls_ca=pki.path("ca.crt"))
    with pytest.raises(ValueError) as bad:
        Client("127.0.0.1:1", token="s3cret token")
    assert "s3cret" not in str(bad.value)
    Client("127.0.0.1:1", token="s3cret").close()  # a token over plaintext is allowed (loopback, tests)
    credentials = Credentials.from_options("", token="s3cret", tls_ca=pki.path("ca.crt"))
    assert credentials.metadata == (("authorization", "Bearer s3cret"),)
    assert "s3cret" not in repr(credentials) and "token=set" in repr(credentials)


class RecordingApi:
    """Stands in for ``grpc``/``grpc.aio`` (the two make channels with the same arguments): records
    which channel ``Credentials.open_channel`` asks for."""

    def __init__(self) -> None:
        self.opened: list[tuple] = []

    def insecure_channel(self, target: str, options=None) -> str:
        self.opened.append(("insecure", target, None, options))
        return "plaintext channel"

    def secure_channel(self, target: str, credentials, options=None) -> str:
        self.opened.append(("secure", target, credentials, options))
        return "tls channel"


def test_one_channel_setup_serves_both_clients(pki) -> None:
    api = RecordingApi()
    option = ("grpc.max_send_message_length", 9)
    plaintext = Credentials.from_options("", token="s3cret")  # a token alone: no TLS
    assert plaintext.open_channel(api, "h:1", [option]) == "plaintext channel"
    tls = Credentials.from_options("grpcs", tls_ca=pki.path("ca.crt"), server_name="specstream-gateway")
    assert tls.open_channel(api, "h:2", [option]) == "tls channel"
    assert api.opened[0] == ("insecure", "h:1", None, [option])
    kind, target, credentials, options = api.opened[1]
    assert (kind, target) == ("secure", "h:2") and isinstance(credentials, grpc.ChannelCredentials)
    assert options == [option, ("grpc.ssl_target_name_override", "specstream-gateway")]  # the caller's first
    # The real modules: a blocking channel for Client, an asyncio one (made in a loop) for AsyncClient.
    with tls.open_channel(grpc, "127.0.0.1:1") as channel:
        assert isinstance(channel, grpc.Channel)

    async def open_aio() -> None:
        channel = tls.open_channel(grpc.aio, "127.0.0.1:1")
        assert isinstance(channel, grpc.aio.Channel)
        await channel.close()

    asyncio.run(open_aio())
