"""The OpenAI-compatible HTTP front's guards, over loopback in front of a scripted target
(tests/support/http_front.py): bearer tokens on every route but health and metrics, with OpenAI's
error shapes; HTTPS serving the gateway's certificate and following its reloads; a client CA that
requires a client certificate from it."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import openai
import pytest

from specstream.data.config import ServerSecurity
from specstream.serving.auth import TokenSet
from specstream.serving.tls import ServerCertificates
from tests.support.http_front import Front, raw_http, run, served
from tests.support.pki import serial_of
from tests.support.scripted_target import MODEL, REPLY, TOKENS, TT


def _token_file(tmp_path, *tokens: str) -> TokenSet:
    path = tmp_path / "api-tokens"
    path.write_text("# the API's tokens\n" + "\n".join(tokens) + "\n")
    return TokenSet(str(path))


def test_tokens_guard_every_route_but_health_and_metrics_with_openai_errors(tmp_path) -> None:
    async def go():
        async with served(tokens=_token_file(tmp_path, "sk-right", "sk-second")) as front:
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
            for method, path, payload in (("GET", "/v1/models", None), ("POST", "/v1/completions", body),
                                          ("GET", "/v1", None), ("GET", "/openapi.json", None),
                                          ("GET", "/docs", None), ("GET", "/nowhere", None)):
                status, headers, data = await raw_http(front.url, path, payload, method)
                assert status == 401, (path, data)
                assert headers["www-authenticate"] == "Bearer"
                error = json.loads(data)["error"]
                assert (error["type"], error["code"], error["param"]) == ("authentication_error", "invalid_api_key",
                                                                          None)
                assert "Bearer" in error["message"]
                status, _, data = await raw_http(front.url, path, payload, method, {"Authorization": "Bearer sk-wrong"})
                assert status == 403, (path, data)
                assert json.loads(data)["error"]["type"] == "permission_error" and "sk-wrong" not in data.decode()
                status, _, _ = await raw_http(front.url, path, payload, method, {"Authorization": "Basic c2stcmlnaHQ="})
                assert status == 401
            assert front.target.requests == []  # refused before anything reached the target
            status, _, data = await raw_http(front.url, "/health", None, "GET")
            assert (status, json.loads(data)) == (200, {"status": "ok"})  # probes send no token
            status, _, _ = await raw_http(front.url, "/metrics", None, "GET")
            assert status == 200  # as on the metrics port: counters only
            status, _, data = await raw_http(front.url, "/v1/completions", body, "POST",
                                         {"Authorization": "Bearer sk-second"})
            assert status == 200 and json.loads(data)["choices"][0]["text"] == REPLY[:len(TT.decode(TOKENS[:2]))]
            # The openai client sends its api_key as the bearer token (always: 401 is for raw callers).
            with pytest.raises(openai.PermissionDeniedError):
                await front.client.models.list()  # api_key "none"
            wrong = front.client.with_options(api_key="sk-wrong")
            with pytest.raises(openai.PermissionDeniedError):
                await wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
            right = front.client.with_options(api_key="sk-right")
            completion = await right.completions.create(model=MODEL, prompt="x", max_tokens=3)
            assert completion.choices[0].text == TT.decode(TOKENS[:3])

    run(go())


def _client_context(pki, certificate: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.path("ca.crt"))
    if certificate:
        context.load_cert_chain(pki.path("client.crt"), pki.path("client.key"))
    return context


def _served_serial(address: str) -> int:
    host, port = address.partition("://")[2].split(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((host, int(port)), timeout=5) as sock, context.wrap_socket(sock) as tls:
        return serial_of(tls.getpeercert(binary_form=True))


def test_https_serves_the_gateways_certificate_and_follows_reloads(pki, tmp_path) -> None:
    cert, key = pki.issue_files("http-before", "specstream-gateway", serial=3001)
    (tmp_path / "tls.crt").write_bytes(open(cert, "rb").read())
    (tmp_path / "tls.key").write_bytes(open(key, "rb").read())
    certificates = ServerCertificates(ServerSecurity(cert_file=str(tmp_path / "tls.crt"),
                                                     key_file=str(tmp_path / "tls.key")))

    async def go():
        async with served(certificates=certificates, client_context=_client_context(pki)) as front:
            assert front.url.startswith("https://")
            completion = await front.client.completions.create(model=MODEL, prompt="x", max_tokens=3)
            assert completion.choices[0].text == TT.decode(TOKENS[:3])
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError)):
                await raw_http(front.url, "/health", None, "GET")  # plaintext HTTP to the HTTPS port
            untrusting = ssl.create_default_context(cafile=pki.other_path("ca.crt"))
            with pytest.raises(ssl.SSLError):
                await raw_http(front.url, "/health", None, "GET", tls=untrusting)
            assert await asyncio.to_thread(_served_serial, front.url) == 3001
            new_cert, new_key = pki.issue_files("http-after", "specstream-gateway", serial=3002)
            (tmp_path / "tls.crt").write_bytes(open(new_cert, "rb").read())
            (tmp_path / "tls.key").write_bytes(open(new_key, "rb").read())
            assert certificates.reload()
            assert await asyncio.to_thread(_served_serial, front.url) == 3002
            status, _, _ = await raw_http(front.url, "/health", None, "GET", tls=_client_context(pki))
            assert status == 200

    run(go())


def test_https_with_a_client_ca_requires_a_client_certificate_from_it(pki, tmp_path) -> None:
    client_ca = tmp_path / "client-ca.crt"
    client_ca.write_bytes(open(pki.path("ca.crt"), "rb").read())
    certificates = ServerCertificates(ServerSecurity(cert_file=pki.path("gateway.crt"),
                                                     key_file=pki.path("gateway.key"), client_ca_file=str(client_ca)))

    async def status(front: Front, context: ssl.SSLContext) -> int | str:
        try:
            return (await raw_http(front.url, "/health", None, "GET", tls=context))[0]
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError, IndexError):  # refused in the handshake
            return "refused"

    async def go():
        async with served(certificates=certificates, client_context=_client_context(pki, certificate=True)) as front:
            completion = await front.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert completion.choices[0].text == TT.decode(TOKENS[:2])
            assert await status(front, _client_context(pki)) == "refused"  # no client certificate
            assert await status(front, _other_client_context(pki)) == "refused"  # one from another CA
            assert await status(front, _client_context(pki, certificate=True)) == 200
            # A reloaded client CA bundle decides new handshakes.
            client_ca.write_bytes(open(pki.other_path("ca.crt"), "rb").read())
            assert certificates.reload()
            assert await status(front, _client_context(pki, certificate=True)) == "refused"
            assert await status(front, _other_client_context(pki)) == 200

    run(go())


def _other_client_context(pki) -> ssl.SSLContext:
    """Trusts the server, presents a certificate from the other CA."""
    context = ssl.create_default_context(cafile=pki.path("ca.crt"))
    context.load_cert_chain(pki.other_path("client.crt"), pki.other_path("client.key"))
    return context
