"""Who may call a server: bearer tokens and, over mTLS, the names a client certificate must carry.

`TokenSet` holds the tokens of a token file (one per line; `#` comments and blank lines ignored)
and checks an `authorization` value against them in constant time: both sides are hashed to
SHA-256 and every known token is compared with `hmac.compare_digest`, so neither the position of
a match nor a token's length shows in the time taken. `AuthInterceptor` is the one place a gRPC
server checks callers; the gateway's HTTP front asks the same `TokenSet` (gateway/http/app.py).

Refusals are errors of specstream/data/errors.py, so their codes are chosen there: no credentials (no
`authorization`, or not a bearer token) is UnauthenticatedError (UNAUTHENTICATED, HTTP 401); a
token that is not known, or a client certificate without an allowed name, is PermissionDeniedError
(PERMISSION_DENIED, HTTP 403). Messages never repeat a token.

`grpc.health.v1` is open to every caller that completes the TLS handshake: probes (the kubelet's,
the launcher's) send no token, and health says nothing about requests. Everything else, reflection
included, is checked.

What it does not know: certificates and TLS (specstream/serving/tls.py; the handshake has already checked
that a client certificate chains to the CA when a call gets here).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

import grpc

from specstream.data.errors import PermissionDeniedError, UnauthenticatedError
from specstream.serving.rpc_handlers import Behavior, rewrap

log = logging.getLogger(__name__)

OPEN_METHODS = "/grpc.health.v1.Health/"  # methods every caller may call
_PEER_NAME_KEYS = ("x509_subject_alternative_name", "x509_common_name")  # grpc's auth-context properties


def read_tokens(path: str) -> list[str]:
    """The tokens of a token file, in order; ValueError naming the file (and the line, never its
    token) when it cannot be read, holds none, or holds one that cannot travel in a header."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token_file={path!r}: cannot be read ({exc})") from None
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
            raise ValueError(f"token_file={path!r}: line {number} must be one token of printable ASCII without "
                             "spaces")
        tokens.append(token)
    if not tokens:
        raise ValueError(f"token_file={path!r}: must hold at least one token (one per line)")
    return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenSet:
    """The tokens a server accepts, from `path`; `reload()` reads the file again."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._digests = [_digest(t) for t in read_tokens(path)]

    def reload(self) -> bool:
        """False (logged, the old tokens kept) when the file cannot be used."""
        try:
            digests = [_digest(t) for t in read_tokens(self.path)]
        except ValueError as exc:
            log.error("tokens not reloaded, keeping the previous ones: %s", exc)
            return False
        self._digests = digests
        log.info("tokens reloaded: %d from %s", len(digests), self.path)
        return True

    def check(self, authorization: str | None) -> None:
        """Passes when `authorization` is `Bearer <a known token>`; raises UnauthenticatedError or
        PermissionDeniedError otherwise."""
        if not authorization:
            raise UnauthenticatedError("a bearer token is required: send `authorization: Bearer <token>`")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthenticatedError("authorization must be `Bearer <token>`")
        presented = _digest(token.strip())
        known = False
        for digest in self._digests:  # no early exit: every token is compared
            known |= hmac.compare_digest(presented, digest)
        if not known:
            raise PermissionDeniedError("the bearer token is not accepted here")


def peer_names(auth_context: dict[str, list[bytes]]) -> set[str]:
    """The names of a verified client certificate: its subject alternative names and common name."""
    return {value.decode(errors="replace") for key in _PEER_NAME_KEYS for value in auth_context.get(key, [])}


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call but grpc.health.v1: the client certificate's names against
    `allowed_peers` (when not empty), then the bearer token against `tokens` (when given)."""

    def __init__(self, tokens: TokenSet | None, allowed_peers: tuple[str, ...] = ()) -> None:
        self.tokens = tokens
        self.allowed_peers = frozenset(allowed_peers)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        return rewrap(handler, self._guard_unary, self._guard_stream)

    def check(self, context: grpc.aio.ServicerContext) -> None:
        """Raises UnauthenticatedError or PermissionDeniedError for a caller that may not call."""
        if self.allowed_peers:
            names = peer_names(context.auth_context())
            if not names & self.allowed_peers:
                raise PermissionDeniedError(f"a client certificate naming {sorted(names)} may not call this service")
        if self.tokens is not None:
            values = [item[1] for item in context.invocation_metadata() or () if item[0] == "authorization"]
            self.tokens.check(values[0] if values else None)

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.check(context)
        except (UnauthenticatedError, PermissionDeniedError) as exc:
            log.info("refused a call from %s: %s", context.peer(), exc)
            await context.abort(exc.code, str(exc))

    def _guard_unary(self, behavior: Behavior) -> Behavior:
        async def guarded(request, context: grpc.aio.ServicerContext):
            await self._admit(context)
            return await behavior(request, context)

        return guarded

    def _guard_stream(self, behavior: Behavior) -> Behavior:
        async def guarded(request, context: grpc.aio.ServicerContext):
            await self._admit(context)
            async for response in behavior(request, context):
                yield response

        return guarded
