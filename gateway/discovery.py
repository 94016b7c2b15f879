"""Target addresses: from the configured entries to one `ip:port` per target replica.

An entry is `host:port` or `dns:///host:port`. An IP literal is one replica. A name is resolved
with `socket.getaddrinfo`, and every address it resolves to becomes a replica (a Kubernetes
headless Service lists one address per ready pod). Only one address family is used per name —
IPv4 when the name has any IPv4 address, else IPv6 — because a dual-stack name (`localhost`, or a
dual-stack pod) lists the same server once per family. The gateway resolves at startup and again
every `target_resolve_interval_s` (gateway/membership.py acts on the changes).

Knows nothing about gRPC or about what a replica serves.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

DNS_SCHEME = "dns:///"

Resolver = Callable[..., list[tuple]]  # socket.getaddrinfo's signature


def split_host_port(entry: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `dns:///host:port` -> (host, port); ValueError naming the entry."""
    rest = entry.removeprefix(DNS_SCHEME)
    host, sep, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"target_url={entry!r}: must be host:port or dns:///host:port")
    return host, int(port)


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve_targets(entries: list[str], getaddrinfo: Resolver = socket.getaddrinfo) -> list[str]:
    """One `ip:port` per replica, in entry order then resolver order, without duplicates."""
    addresses: list[str] = []
    for entry in entries:
        host, port = split_host_port(entry)
        for ip in _resolve(host, port, getaddrinfo):
            address = format_address(ip, port)
            if address not in addresses:
                addresses.append(address)
    return addresses


def _resolve(host: str, port: int, getaddrinfo: Resolver) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass  # a name, not an IP literal
    try:
        infos = getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"target_url: cannot resolve {host!r}: {exc}") from exc
    by_family: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for family, _type, _proto, _name, sockaddr in infos:
        ips = by_family.get(family)
        if ips is not None and sockaddr[0] not in ips:
            ips.append(sockaddr[0])
    ips = by_family[socket.AF_INET] or by_family[socket.AF_INET6]
    if not ips:
        raise ValueError(f"target_url: {host!r} resolved to no IPv4 or IPv6 address")
    return ips
