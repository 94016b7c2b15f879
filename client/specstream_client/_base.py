"""``ClientBase``: the half of ``Client`` and ``AsyncClient`` that does no I/O -- the constructor's
keywords, checked once (the url, the default deadline, the channel's security), and the ``Call``
each method makes.

Contract: ``ClientBase.__init__`` is both clients' constructor. It raises before any channel exists:
``ValueError`` for a url that is not ``host:port``, ``grpc://host:port`` or ``grpcs://host:port``,
and for a timeout <= 0; ``TypeError``/``ValueError`` for the security options (``_credentials.py``).
It ends by calling ``_open()``, which each client defines: ``Client`` opens its blocking channel
there; ``AsyncClient`` defers its channel to first use, inside the event loop. ``_call`` gives the
call a method makes (the request with the call's deadline -- the client's ``timeout`` when the call
gives none -- and the token's metadata); a client only starts it and blocks on or awaits it.

What it does not know: blocking or asyncio -- it never makes a channel itself (``_open_channel``
makes one for the module a client names) and never starts a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.message import Message

from ._call import Call, R, Rpc, resolve_timeout
from ._credentials import ChannelApi, Credentials, PemSource

__all__ = ["ClientBase", "parse_target"]


def parse_target(url: str) -> tuple[str, str]:
    """``"host:port"``, ``"grpc://host:port"`` or ``"grpcs://host:port"`` -> (target, scheme), the
    scheme being ``""`` for a bare ``host:port``."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"url must be 'host:port' or 'grpc://host:port', got {url!r}")
    url = url.strip()
    scheme = ""
    if "://" in url:
        scheme, _, rest = url.partition("://")
        scheme = scheme.lower()
        if scheme not in ("grpc", "grpcs"):
            raise ValueError(f"url scheme must be grpc:// or grpcs://, got {url!r}")
        url = rest.rstrip("/")
    if not url or "/" in url:
        raise ValueError(f"url must be 'host:port' or 'grpc://host:port', got {url!r}")
    return url, scheme


class ClientBase:
    """What ``Client`` and ``AsyncClient`` share; see the module docstring. Not used on its own."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        server_name: str | None = None,
        token: str | None = None,
    ) -> None:
        target, scheme = parse_target(url)
        # Public and writable: a call without its own timeout reads it when it is made.
        self.timeout: float | None = resolve_timeout(None, timeout)
        self.target: str = target
        self._credentials = Credentials.from_options(scheme, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                                     server_name=server_name, token=token)
        self._metadata = self._credentials.metadata
        self._channel_options = list(options)  # the caller's; the credentials add theirs
        self._open()

    def _open(self) -> None:
        """Called last by ``__init__``, the arguments all checked: opens the channel, or prepares to."""
        raise NotImplementedError

    def _open_channel(self, api: ChannelApi) -> Any:
        """The channel to ``target`` with the client's security and options: ``api`` is ``grpc`` or
        ``grpc.aio``."""
        return self._credentials.open_channel(api, self.target, self._channel_options)

    def _deadline(self, timeout: float | None) -> float | None:
        """A call's deadline: its ``timeout``, else the client's; checked."""
        return resolve_timeout(timeout, self.timeout)

    def _call(self, rpc: Rpc[R], request: Message, timeout: float | None) -> Call[R]:
        return Call(rpc, request, self._deadline(timeout), self._metadata)
