"""The security of a client's channel: TLS (a CA bundle, a client certificate for mTLS, the name to
expect in the server's certificate) and the bearer token sent with every call. Shared by ``Client``
and ``AsyncClient``.

Contract: ``Credentials.from_options`` checks the ``Client`` keywords once, when the client is
made, and reads the PEM files then: ``TypeError`` for a wrong type, ``ValueError`` (naming the
option and quoting a path, never a token) for a file that cannot be read or is not PEM of the
right kind, a certificate without its key, TLS options on a ``grpc://`` (plaintext) url, or a
token that cannot travel in a header. TLS is on with ``grpcs://`` or any ``tls_*`` option; without
``tls_ca`` the system's CAs check the server. The token goes as ``authorization: Bearer <token>``
metadata, over plaintext too when TLS is off (where anyone on the path can read it).
``open_channel`` makes the channel with them, blocking or asyncio (``grpc`` or ``grpc.aio``: the two
take the same arguments).

What it does not know: the server's names, and reloading (files are read once; make a new client
to pick up new ones).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union

import grpc

__all__ = ["ChannelApi", "Credentials", "PemSource"]

PemSource = Union[str, os.PathLike, bytes]  # a file's path, or the PEM text itself as bytes


class ChannelApi(Protocol):
    """The module that makes a client's channel: ``grpc`` (blocking) or ``grpc.aio`` (asyncio)."""

    def insecure_channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None) -> Any: ...

    def secure_channel(self, target: str, credentials: grpc.ChannelCredentials,
                       options: Sequence[tuple[str, Any]] | None = None) -> Any: ...


_CERTIFICATE = b"CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


def _pem(name: str, value: PemSource | None, marker: bytes, what: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
        shown = "<bytes>"
    elif isinstance(value, str | os.PathLike):
        shown = repr(os.fspath(value))
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"{name}={shown}: cannot be read ({exc.strerror})") from None
    else:
        raise TypeError(f"{name} must be a file path or PEM bytes, got {type(value).__name__}")
    if marker not in data:
        raise ValueError(f"{name}={shown}: must be PEM {what}")
    return data


def _token(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"token must be a str, got {type(value).__name__}")
    token = value.strip()
    if not token or not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ValueError("token must be non-empty printable ASCII without spaces (its value is not shown)")
    return token


@dataclass(frozen=True)
class Credentials:
    """What a client's channel and calls carry; made by ``from_options``."""

    tls: bool
    root_certificates: bytes | None  # None with TLS: the system's CAs
    private_key: bytes | None
    certificate_chain: bytes | None
    server_name: str | None
    token: str | None

    @classmethod
    def from_options(cls, scheme: str, *, tls_ca: PemSource | None = None, tls_cert: PemSource | None = None,
                     tls_key: PemSource | None = None, server_name: str | None = None,
                     token: str | None = None) -> Credentials:
        """``scheme``: the url's ("grpc", "grpcs", or "" for a bare host:port)."""
        wants_tls = any(v is not None for v in (tls_ca, tls_cert, tls_key, server_name))
        if scheme == "grpc" and wants_tls:
            raise ValueError("tls_ca, tls_cert, tls_key and server_name need TLS: the url's grpc:// is plaintext "
                             "(use grpcs:// or host:port)")
        if (tls_cert is None) != (tls_key is None):
            given, missing = ("tls_cert", "tls_key") if tls_key is None else ("tls_key", "tls_cert")
            raise ValueError(f"{given} needs {missing}: a client certificate goes with its private key")
        if server_name is not None and (not isinstance(server_name, str) or not server_name.strip()):
            raise ValueError(f"server_name must be a non-empty str, got {server_name!r}")
        key = _pem("tls_key", tls_key, _PRIVATE_KEY, "holding a private key")
        if key is not None and b"ENCRYPTED" in key:
            raise ValueError("tls_key: must not be encrypted (grpc takes no passphrase)")
        return cls(tls=scheme == "grpcs" or wants_tls,
                   root_certificates=_pem("tls_ca", tls_ca, _CERTIFICATE, "holding CA certificates"),
                   private_key=key,
                   certificate_chain=_pem("tls_cert", tls_cert, _CERTIFICATE, "holding a certificate"),
                   server_name=server_name, token=_token(token))

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: a plaintext channel."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates, private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def open_channel(self, api: ChannelApi, target: str, options: Sequence[tuple[str, Any]] = ()) -> Any:
        """A channel to ``target`` with this security and the caller's channel ``options``: a
        ``grpc.Channel`` with ``api=grpc``, a ``grpc.aio.Channel`` with ``api=grpc.aio`` (bound to the
        event loop running now)."""
        options = [*options, *self.channel_options()]
        credentials = self.channel_credentials()
        if credentials is None:
            return api.insecure_channel(target, options=options)
        return api.secure_channel(target, credentials, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Every call's metadata: the bearer token (None without one)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def __repr__(self) -> str:  # never the token, nor key bytes
        return (f"Credentials(tls={self.tls}, tls_ca={'set' if self.root_certificates else None}, "
                f"client_cert={'set' if self.certificate_chain else None}, server_name={self.server_name!r}, "
                f"token={'set' if self.token else None})")
