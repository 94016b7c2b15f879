"""Certificates: what a server presents and which client certificates it accepts, reloadable; and
the credentials of a channel to one of our servers.

`ServerCertificates` reads a server's certificate, key and (for mTLS) client CA bundle once at start
and again on `reload()` (SIGHUP, specstream/serving/grpc_server.py). New TLS handshakes use the files read
last; connections already open keep theirs. A reload that fails (a missing file, a key that does not
match its certificate) is logged and changes nothing. Both fronts of the gateway read the same
object: gRPC through `grpc.dynamic_ssl_server_credentials`, whose fetcher grpc calls before every
handshake, and HTTPS through an `ssl.SSLContext` whose SNI callback (called for every handshake,
with or without SNI) moves the connection to the latest context.

What it does not know: tokens (specstream/serving/auth.py), and which names a peer may have (the allow-list
is checked per call, by auth.AuthInterceptor). Channel credentials are read once, when a channel is
made: a service's own client certificate is not reloaded (grpc's channel credentials are fixed).
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from specstream.data.config import ChannelSecurity, ServerSecurity

log = logging.getLogger(__name__)


def _read(name: str, path: str, marker: str) -> bytes:
    """The file's bytes; ValueError naming the setting when it cannot be read or holds no PEM `marker`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}={path!r}: cannot be read ({exc.strerror})") from None
    if marker.encode() not in data:
        raise ValueError(f"{name}={path!r}: must be a PEM file with a {marker.strip('-')} block")
    return data


CERTIFICATE = "CERTIFICATE-----"
PRIVATE_KEY = "PRIVATE KEY-----"  # PKCS#8, RSA or EC


@dataclass(frozen=True)
class _Loaded:
    """One reading of the files, checked: the key matches the certificate, the bundle parses."""

    grpc_config: grpc.ServerCertificateConfiguration
    ssl_context: ssl.SSLContext


class ServerCertificates:
    """A server's TLS identity and client CA, read from `security`'s files, reloadable."""

    def __init__(self, security: ServerSecurity) -> None:
        assert security.tls, "ServerCertificates needs cert_file and key_file"
        self.security = security
        self._lock = threading.Lock()
        self._current = self._load()
        self._pending: grpc.ServerCertificateConfiguration | None = None  # for grpc's next handshake
        self._entry = self._current.ssl_context  # the context the HTTPS server holds; it hands over
        self._entry.sni_callback = self._switch

    @property
    def mtls(self) -> bool:
        return self.security.mtls

    def _load(self) -> _Loaded:
        s = self.security
        cert = _read("cert_file", s.cert_file, CERTIFICATE)
        key = _read("key_file", s.key_file, PRIVATE_KEY)
        if b"ENCRYPTED" in key:  # OpenSSL would prompt for its passphrase on the terminal
            raise ValueError(f"key_file={s.key_file!r}: must not be encrypted (no passphrase can be given)")
        ca = _read("client_ca_file", s.client_ca_file, CERTIFICATE) if s.client_ca_file else None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(s.cert_file, s.key_file)  # checks that the key is the certificate's
        except ssl.SSLError as exc:
            raise ValueError(f"key_file={s.key_file!r}: not the private key of cert_file={s.cert_file!r} "
                             f"({exc.reason})") from None
        if ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            except ssl.SSLError as exc:
                raise ValueError(f"client_ca_file={s.client_ca_file!r}: not a CA bundle ({exc.reason})") from None
        return _Loaded(grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca), context)

    def reload(self) -> bool:
        """Reads the files again; new handshakes use them. False (logged, nothing changed) when
        they cannot be used."""
        try:
            loaded = self._load()
        except ValueError as exc:
            log.error("TLS files not reloaded, keeping the previous ones: %s", exc)
            return False
        with self._lock:
            self._current = loaded
            self._pending = loaded.grpc_config
        log.info("TLS files reloaded: %s", self.security.cert_file)
        return True

    # ----- gRPC ------------------------------------------------------------------------------------
    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._current.grpc_config, self._fetch,
                                                   require_client_authentication=self.mtls)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # grpc calls this before every handshake: a new configuration once after a reload, else
        # None (keep the one it has).
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    # ----- HTTPS -----------------------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        """The context for an HTTPS server; it follows reloads."""
        return self._entry

    def _switch(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self._current.ssl_context
        if current is not context:
            connection.context = current


def channel_credentials(security: ChannelSecurity) -> grpc.ChannelCredentials:
    """TLS credentials of a channel to one of our servers: its CA bundle and, for mTLS, this side's
    certificate and key."""
    assert security.tls, f"{security.label}: no ca_file"
    label = security.label
    ca = _read(f"{label}.ca_file", security.ca_file, CERTIFICATE)
    if security.cert_file is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca,
                                        private_key=_read(f"{label}.key_file", security.key_file, PRIVATE_KEY),
                                        certificate_chain=_read(f"{label}.cert_file", security.cert_file, CERTIFICATE))


def channel_options(security: ChannelSecurity | None) -> list[tuple[str, str]]:
    """grpc options the channel's security needs: the name to check in the server's certificate."""
    if security is not None and security.server_name:
        return [("grpc.ssl_target_name_override", security.server_name)]
    return []
