"""Throwaway certificate authorities for the TLS tests (the `pki` fixture in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.certs import Authority, issue, make_authority, write_file, write_stack_files


@dataclass
class Pki:
    root: Path
    authority: Authority  # signed everything in `dir`
    dir: Path
    other: Path  # the same files from another CA

    @classmethod
    def make(cls, root: Path) -> Pki:
        authority = make_authority("specstream test CA")
        return cls(root, authority, write_stack_files(root / "ca1", authority),
                   write_stack_files(root / "ca2", make_authority("another CA")))

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def other_path(self, name: str) -> str:
        return str(self.other / name)

    def issue_files(self, stem: str, common_name: str, serial: int | None = None,
                    dns_names: tuple[str, ...] = ("localhost",)) -> tuple[str, str]:
        """A new certificate + key from the first CA, as files `<stem>.crt`/`.key` (replaced if
        there): (cert path, key path)."""
        cert, key = issue(self.authority, common_name, dns_names, ("127.0.0.1",), serial=serial)
        out = self.root / "issued"
        out.mkdir(exist_ok=True)
        write_file(out / f"{stem}.crt", cert)
        write_file(out / f"{stem}.key", key, private=True)
        return str(out / f"{stem}.crt"), str(out / f"{stem}.key")


def serial_of(cert_pem: bytes) -> int:
    """A PEM certificate's serial number (DER works too: what `getpeercert(binary_form=True)` gives)."""
    from cryptography import x509

    if cert_pem.lstrip().startswith(b"-----"):
        return x509.load_pem_x509_certificate(cert_pem).serial_number
    return x509.load_der_x509_certificate(cert_pem).serial_number
