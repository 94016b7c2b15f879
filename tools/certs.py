"""A throwaway certificate authority and certificates, for a stack on one machine (`specstream serve
--tls-dir`) and for tests. Not for production: there, certificates come from your own CA (e.g.
cert-manager; deploy/README.md).

`write_stack_files(directory)` writes what `launcher.StackSecurity` reads: `ca.crt`; one certificate
and key per role (`gateway`, `target`, `draft`, `client`), each naming `specstream-<role>` (its
common name and a DNS subject alternative name, the names the allow-lists check) plus `localhost`,
this host's names and the loopback addresses, valid for serving and for calling (both extended key
usages); `api-tokens` (the public API's token) and `internal-token` (the one the services send each
other). Keys are ECDSA P-256, written 0600; the CA's key is not written, so nothing more can be
issued from it later.

Needs the `cryptography` package (`pip install 'specstream[tls]'`), imported only when called.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("gateway", "target", "draft", "client")
VALID_DAYS = 365


def _crypto() -> None:
    """Raises a RuntimeError saying what to install when `cryptography` is missing."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise RuntimeError("making certificates needs the cryptography package: pip install 'specstream[tls]'") \
            from None


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate (PEM) and its private key (a cryptography key object)."""

    cert_pem: bytes
    key: Any


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_authority(name: str = "specstream test CA", days: int = VALID_DAYS) -> Authority:
    """A self-signed CA that may sign leaf certificates only."""
    _crypto()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Authority(cert.public_bytes(serialization.Encoding.PEM), key)


def issue(authority: Authority, common_name: str, dns_names: tuple[str, ...] = (),
          ip_addresses: tuple[str, ...] = (), serial: int | None = None,
          days: int = VALID_DAYS) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) signed by `authority`, for serving and for calling."""
    _crypto()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    ca = x509.load_pem_x509_certificate(authority.cert_pem)
    names = [x509.DNSName(name) for name in dict.fromkeys(dns_names)] + \
        [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ip_addresses)]
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(serial if serial is not None else x509.random_serial_number())
               .not_valid_before(_now() - datetime.timedelta(minutes=5))
               .not_valid_after(_now() + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(authority.key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def peer_name(role: str) -> str:
    """The name a role's certificate carries for the allow-lists: `specstream-<role>`."""
    return f"specstream-{role}"


def _host_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for name in (socket.gethostname(), socket.getfqdn()) if name))


def write_file(path: Path, data: bytes, private: bool = False) -> None:
    """Writes `data`; a private file is created 0600 (never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def write_stack_files(directory: str | Path, authority: Authority | None = None) -> Path:
    """Writes a stack's CA, certificates and tokens into `directory` (created; files there are
    replaced). Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    authority = authority or make_authority()
    write_file(out / "ca.crt", authority.cert_pem)
    for role in ROLES:
        cert, key = issue(authority, peer_name(role), (peer_name(role), "localhost", *_host_names()),
                          ("127.0.0.1", "::1"))
        write_file(out / f"{role}.crt", cert)
        write_file(out / f"{role}.key", key, private=True)
    write_file(out / "api-tokens", (new_token() + "\n").encode(), private=True)
    write_file(out / "internal-token", (new_token() + "\n").encode(), private=True)
    return out


def new_token() -> str:
    """A random bearer token (256 bits, URL-safe) that does not start with "-": one that did (1 in
    64 of ``secrets.token_urlsafe``'s) would be read as a flag after ``--token`` on a command line."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token
