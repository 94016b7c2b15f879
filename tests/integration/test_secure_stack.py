"""The three real processes with every hop secured (launcher StackSecurity): mTLS plus the internal
token between gateway, target and draft, each accepting only its caller's certificate; mTLS plus
the API token on the public API, gRPC and HTTPS. Generation through the SDK and through the
`openai` client; every way in that a caller without the right credentials tries is refused (the
attack: a client straight to the draft or the target port); reflection off on target and draft;
SIGHUP makes new connections see new certificates. Then the internal token alone, without TLS,
on a draft and a target started by hand; and `specstream serve --tls-dir` as a user runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specstream.data.config import ChannelSecurity
from specstream.serving.channels import open_blocking_channel
from tests.support.pki import serial_of
from tools.certs import issue, make_authority, write_file
from tools.launcher import StackSecurity, free_port, wait_healthy
from specstream_client import AsyncClient, Client, PermissionDenied, Unauthenticated, Unavailable
from specstream_pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

MAX_NEW = 16
PROMPT = "The weather"


@pytest.fixture(scope="module")
def tls_dir(pki, tmp_path_factory) -> Path:
    """A copy of the pki's files (this module replaces a certificate in it)."""
    return Path(shutil.copytree(pki.dir, tmp_path_factory.mktemp("stack-tls") / "tls"))


@pytest.fixture(scope="module")
def stack(stack_factory, model_zoo, tls_dir):
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4, http_port=0,
                         security=StackSecurity(str(tls_dir), client_certs=True))


def _token(directory: Path, name: str = "api-tokens") -> str:
    return (directory / name).read_text().split()[0]


def _sdk(directory: Path, **changes) -> dict:
    options = dict(tls_ca=str(directory / "ca.crt"), tls_cert=str(directory / "client.crt"),
                   tls_key=str(directory / "client.key"), token=_token(directory))
    return {**options, **changes}


def _as(directory: Path, role: str | None, token: str | None = None, ca: Path | None = None,
        server_name: str | None = None) -> ChannelSecurity:
    """Credentials of a direct caller: `role`'s certificate (None: none) and a token file's first
    token (None: none)."""
    return ChannelSecurity(label="direct", ca_file=str(ca or directory / "ca.crt"),
                           cert_file=str(directory / f"{role}.crt") if role else None,
                           key_file=str(directory / f"{role}.key") if role else None,
                           server_name=server_name, token_file=str(directory / token) if token else None)


def _code(call) -> grpc.StatusCode:
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def _speculate(address: str, security: ChannelSecurity | None, sequences: int = 1) -> grpc.StatusCode:
    """One propose round trip for `sequences` sequences on a fresh Speculate stream, as a target
    sends it (the probed attack held all 64 draft slots this way)."""
    request = draft_pb2.ProposeRequest(propose=draft_pb2.ProposeBatch(step=1, items=[
        draft_pb2.ProposeItem(seq_id=i, rollback_to=0, append_token_ids=[5, 6, 7, 5, 6], gamma=2)
        for i in range(1, sequences + 1)]))

    def go() -> None:
        with open_blocking_channel(address, security=security) as channel:
            reply = next(draft_pb2_grpc.DraftStub(channel).Speculate(iter([request]), timeout=10))
            assert reply.step == 1 and len(reply.proposals) == sequences

    return _code(go)


def _connect(address: str, security: ChannelSecurity | None, sequences: int = 50) -> grpc.StatusCode:
    """A Connect stream that submits `sequences` requests, as the probed attack did."""
    submit = target_pb2.GatewayMessage(submit=target_pb2.Submit(requests=[
        target_pb2.SequenceRequest(id=str(i), prompt_token_ids=[5, 6, 7], max_new_tokens=8) for i in range(sequences)]))

    def go() -> None:
        with open_blocking_channel(address, security=security) as channel:
            next(target_pb2_grpc.TargetStub(channel).Connect(iter([submit]), timeout=10))

    return _code(go)


def _services(address: str, security: ChannelSecurity | None) -> set[str]:
    with open_blocking_channel(address, security=security) as channel:
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]),
                                                                                             timeout=10))
        return {s.name for s in reply.list_services_response.service}


def _served_serial(address: str) -> int:
    host, port = address.rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((host, int(port)), timeout=10) as sock, context.wrap_socket(sock) as tls:
        return serial_of(tls.getpeercert(binary_form=True))


def _https(url: str, context: ssl.SSLContext, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _client_context(directory: Path, role: str = "client") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(directory / "ca.crt"))
    context.load_cert_chain(str(directory / f"{role}.crt"), str(directory / f"{role}.key"))
    return context


# ---- generating over the secured hops -----------------------------------------------------------


def test_generates_through_the_sdk_with_mtls_and_tokens_on_every_hop(stack, tls_dir) -> None:
    with Client(stack.gateway_address, timeout=120, **_sdk(tls_dir)) as client:
        plain = client.generate(PROMPT, max_new_tokens=MAX_NEW, speculation="off", ignore_eos=True)
        spec = client.generate(PROMPT, max_new_tokens=MAX_NEW, speculation=4, ignore_eos=True)
        streamed = list(client.generate_stream(PROMPT, max_new_tokens=MAX_NEW, speculation=4, ignore_eos=True))
        info = client.model_info()
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == MAX_NEW
    assert "".join(chunk.text for chunk in streamed) == plain.text
    # The target reached the draft over mTLS with the internal token: it proposed.
    assert spec.stats.draft_tokens > 0 and info.draft_connected

    async def go():
        async with AsyncClient(stack.gateway_address, timeout=120, **_sdk(tls_dir)) as client:
            return await client.generate(PROMPT, max_new_tokens=MAX_NEW, speculation="auto", ignore_eos=True)

    assert asyncio.run(go()).token_ids == plain.token_ids


def test_generates_through_the_openai_client_over_https(stack, tls_dir) -> None:
    assert stack.http_base_url.startswith("https://")
    http_client = openai.DefaultHttpxClient(verify=_client_context(tls_dir))
    with openai.OpenAI(base_url=stack.http_base_url, api_key=_token(tls_dir), max_retries=0, timeout=120,
                       http_client=http_client) as client:
        [model] = client.models.list().data
        completion = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                               extra_body={"ignore_eos": True})
        with Client(stack.gateway_address, timeout=120, **_sdk(tls_dir)) as sdk:
            expected = sdk.generate(PROMPT, max_new_tokens=MAX_NEW, speculation="off", ignore_eos=True).text
        assert completion.choices[0].text == expected
        wrong = client.with_options(api_key="sk-wrong")
        with pytest.raises(openai.PermissionDeniedError):
            wrong.models.list()


def test_the_public_api_refuses_callers_without_the_right_credentials(stack, tls_dir, pki) -> None:
    refusals = [
        ({"token": None}, Unauthenticated),
        ({"token": _token(tls_dir, "internal-token")}, PermissionDenied),  # the services' token is not the API's
        ({"tls_cert": None, "tls_key": None}, Unavailable),  # --client-certs: no certificate, no handshake
        ({"tls_cert": pki.other_path("client.crt"), "tls_key": pki.other_path("client.key")}, Unavailable),
        ({"tls_ca": pki.other_path("ca.crt")}, Unavailable),  # a client trusting another CA refuses the gateway
    ]
    for changes, error in refusals:
        with Client(stack.gateway_address, timeout=30, **_sdk(tls_dir, **changes)) as client, \
                pytest.raises(error):
            client.generate(PROMPT, max_new_tokens=2)
    with Client(stack.gateway_address, timeout=30) as plaintext, pytest.raises(Unavailable):
        plaintext.generate(PROMPT, max_new_tokens=2)
    base = stack.http_base_url
    assert _https(f"{base}/models", _client_context(tls_dir), None)[0] == 401
    assert _https(f"{base}/models", _client_context(tls_dir), "sk-wrong")[0] == 403
    status, body = _https(f"{base}/models", _client_context(tls_dir), _token(tls_dir))
    assert status == 200 and json.loads(body)["data"]
    status, body = _https(base.removesuffix("/v1") + "/health", _client_context(tls_dir), None)
    assert (status, json.loads(body)) == (200, {"status": "ok"})  # health needs no token
    no_certificate = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _https(f"{base}/models", no_certificate, _token(tls_dir))


# ---- the attack: clients straight to the internal ports -----------------------------------------


def test_a_direct_client_to_the_draft_is_refused_and_holds_nothing(stack, tls_dir, pki) -> None:
    draft = stack.addresses["draft"]
    name = "specstream-draft"

    def held() -> int:
        with stack.channel("draft") as channel:
            return draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.DraftInfoRequest(), timeout=10).held_sequences

    def attack(security: ChannelSecurity | None) -> grpc.StatusCode:
        return _speculate(draft, security, sequences=64)

    before = held()
    plaintext = _code(lambda: draft_pb2_grpc.DraftStub(open_blocking_channel(draft)).GetInfo(
        draft_pb2.DraftInfoRequest(), timeout=10))
    assert plaintext == grpc.StatusCode.UNAVAILABLE
    assert attack(None) == grpc.StatusCode.UNAVAILABLE
    assert attack(_as(tls_dir, None, "internal-token", server_name=name)) == grpc.StatusCode.UNAVAILABLE
    other = ChannelSecurity(label="other", ca_file=str(tls_dir / "ca.crt"), cert_file=pki.other_path("target.crt"),
                            key_file=pki.other_path("target.key"), server_name=name,
                            token_file=str(tls_dir / "internal-token"))
    assert attack(other) == grpc.StatusCode.UNAVAILABLE  # a certificate from another CA
    # Certificates from the stack's own CA that are not the target's: the allow-list.
    for role in ("client", "gateway"):
        assert attack(_as(tls_dir, role, "internal-token", server_name=name)) == grpc.StatusCode.PERMISSION_DENIED
    assert attack(_as(tls_dir, "target", None, server_name=name)) == grpc.StatusCode.UNAUTHENTICATED
    assert attack(_as(tls_dir, "target", "api-tokens", server_name=name)) == grpc.StatusCode.PERMISSION_DENIED
    assert held() == before  # none of the refused streams got a slot
    # The target's credentials are served.
    assert _speculate(draft, stack.calling("draft")) == grpc.StatusCode.OK


def test_a_direct_client_to_the_target_is_refused_and_queues_nothing(stack, tls_dir, pki) -> None:
    target = stack.addresses["target"]
    name = "specstream-target"
    assert _connect(target, None) == grpc.StatusCode.UNAVAILABLE
    assert _connect(target, _as(tls_dir, None, "internal-token", server_name=name)) == grpc.StatusCode.UNAVAILABLE
    other = ChannelSecurity(label="other", ca_file=str(tls_dir / "ca.crt"), cert_file=pki.other_path("gateway.crt"),
                            key_file=pki.other_path("gateway.key"), server_name=name,
                            token_file=str(tls_dir / "internal-token"))
    assert _connect(target, other) == grpc.StatusCode.UNAVAILABLE
    for role in ("client", "draft"):
        assert _connect(target, _as(tls_dir, role, "internal-token", server_name=name)) \
            == grpc.StatusCode.PERMISSION_DENIED
    assert _connect(target, _as(tls_dir, "gateway", None, server_name=name)) == grpc.StatusCode.UNAUTHENTICATED
    assert _connect(target, _as(tls_dir, "gateway", "api-tokens", server_name=name)) \
        == grpc.StatusCode.PERMISSION_DENIED
    with stack.channel("target") as channel:  # as the gateway: served
        load = target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=10).load
    assert load.queued == 0 and load.running == 0  # none of the refused 50-sequence submits got in


def test_reflection_is_off_on_target_and_draft_and_on_for_the_gateway(stack, tls_dir) -> None:
    for name in ("target", "draft"):
        with pytest.raises(grpc.RpcError) as off:
            _services(stack.addresses[name], stack.calling(name))  # even with the right credentials
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
    gateway = stack.calling("gateway")
    assert "specstream.v1.Generation" in _services(stack.gateway_address, gateway)
    without_token = ChannelSecurity(label="x", ca_file=gateway.ca_file, cert_file=gateway.cert_file,
                                    key_file=gateway.key_file)
    with pytest.raises(grpc.RpcError) as refused:
        _services(stack.gateway_address, without_token)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- reloading ----------------------------------------------------------------------------------


def test_sighup_serves_new_certificates_to_new_connections(stack, tls_dir, pki) -> None:
    http = stack.http_address
    before = _served_serial(stack.gateway_address)
    assert _served_serial(http) == before
    cert, key = issue(pki.authority, "specstream-gateway", ("specstream-gateway", "localhost"), ("127.0.0.1",),
                      serial=before + 1)
    write_file(tls_dir / "gateway.crt", cert)
    write_file(tls_dir / "gateway.key", key, private=True)
    target_cert, target_key = issue(pki.authority, "specstream-target", ("specstream-target", "localhost"),
                                    ("127.0.0.1",), serial=7007)
    write_file(tls_dir / "target.crt", target_cert)
    write_file(tls_dir / "target.key", target_key, private=True)
    assert _served_serial(stack.gateway_address) == before  # files alone change nothing
    stack.reload()  # SIGHUP to every process
    deadline = time.monotonic() + 30
    while _served_serial(stack.gateway_address) != before + 1:
        assert time.monotonic() < deadline, "the gateway still serves its old certificate"
        time.sleep(0.1)
    assert _served_serial(http) == before + 1
    while _served_serial(stack.addresses["target"]) != 7007:
        assert time.monotonic() < deadline, "the target still serves its old certificate"
        time.sleep(0.1)
    assert stack.alive()
    # The gateway's Connect stream to the target, opened before, carries on; new callers see the
    # new certificates and are served.
    with Client(stack.gateway_address, timeout=120, **_sdk(tls_dir)) as client:
        assert len(client.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids) == 4


# ---- the internal token without TLS ---------------------------------------------------------------


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.cli", *args], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def test_the_internal_token_alone_guards_draft_and_target(model_zoo, tmp_path) -> None:
    (tmp_path / "internal").write_text("# shared by target and draft\ninternal-secret\n")
    (tmp_path / "wrong").write_text("not-it\n")
    token = str(tmp_path / "internal")
    draft_port, target_port = free_port(), free_port()
    draft = _start(["draft", "--proposer", "ngram", "--port", str(draft_port), "--token-file", token],
                   tmp_path / "draft.log")
    target = None
    try:
        draft_address, target_address = f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}"
        wait_healthy(draft_address, 60, draft)  # health needs no token
        sends = ChannelSecurity(label="t", token_file=token)
        wrong = ChannelSecurity(label="t", token_file=str(tmp_path / "wrong"))
        assert _speculate(draft_address, None) == grpc.StatusCode.UNAUTHENTICATED
        assert _speculate(draft_address, wrong) == grpc.StatusCode.PERMISSION_DENIED
        assert _speculate(draft_address, sends) == grpc.StatusCode.OK
        target = _start(["target", "--model", str(model_zoo["target"]), "--port", str(target_port), "--no-calibrate",
                         "--max-seq-len", "256", "--dtype", "float32", "--token-file", token,
                         "--draft-url", draft_address, "--draft-token-file", token], tmp_path / "target.log")
        wait_healthy(target_address, 120, target)
        assert _connect(target_address, None) == grpc.StatusCode.UNAUTHENTICATED
        assert _connect(target_address, wrong) == grpc.StatusCode.PERMISSION_DENIED
        with open_blocking_channel(target_address, security=sends) as channel:
            stub = target_pb2_grpc.TargetStub(channel)
            deadline = time.monotonic() + 30
            while not (info := stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=10)).draft_model_name:
                assert time.monotonic() < deadline, "the target never reached its draft with the token"
                time.sleep(0.2)
        assert info.draft_model_name and info.load.queued == 0
        with pytest.raises(grpc.RpcError) as off:
            _services(draft_address, sends)
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        codes = [_stop(proc) for proc in (target, draft) if proc is not None]
    assert codes == [0] * len(codes), (tmp_path / "target.log").read_text()[-2000:]


# ---- specstream serve --tls-dir -------------------------------------------------------------------


def test_serve_tls_dir_makes_its_files_prints_how_to_call_and_passes_sighup_on(model_zoo, tmp_path) -> None:
    directory = tmp_path / "tls"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--target", str(model_zoo["target"]),
                             "--draft", str(model_zoo["same"]), "--port", "0", "--max-seq-len", "256",
                             "--no-calibrate", "--tls-dir", str(directory), "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "TLS on every hop" in line or "error" in line:
                break
        output = "".join(lines)
        assert "wrote a new CA, certificates and tokens" in output, output
        address = re.search(r"listening on (\S+)", output).group(1)
        assert f"--tls-ca {directory / 'ca.crt'}" in output and str(directory / "api-tokens") in output
        with Client(address, timeout=60, tls_ca=str(directory / "ca.crt"), token=_token(directory)) as client:
            result = client.generate(PROMPT, max_new_tokens=6, ignore_eos=True, speculation=2)
        assert len(result.token_ids) == 6 and result.stats.accepted_tokens == result.stats.draft_tokens > 0
        with Client(address, timeout=60, tls_ca=str(directory / "ca.crt")) as client, pytest.raises(Unauthenticated):
            client.generate(PROMPT, max_new_tokens=2)
        before = _served_serial(address)
        # The directory keeps no CA key, so another CA signs the replacement: what is checked is
        # which certificate a new connection is shown.
        cert, key = issue(make_authority("rotated"), "specstream-gateway", ("localhost",), ("127.0.0.1",),
                          serial=before + 1)
        write_file(directory / "gateway.crt", cert)
        write_file(directory / "gateway.key", key, private=True)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while _served_serial(address) != before + 1:
            assert time.monotonic() < deadline and proc.poll() is None, "SIGHUP did not reach the gateway"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert re.search(r"stopped: \{'draft': 0, 'target': 0, 'gateway': 0\}", rest), rest
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
