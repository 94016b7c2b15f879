"""Exceptions raised by the specstream client SDK.

Contract: every failed RPC surfaces as a ``SpecstreamError`` (or a subclass picked by the gRPC status
code), with ``.code`` (``grpc.StatusCode``) and ``.details`` (the server's message); ``str()`` shows
both. The original ``grpc.RpcError`` is kept as ``__cause__``. The class is chosen in one place,
``from_rpc_error``; ``map_rpc_errors`` applies it around any call, blocking or awaited, unary or a
stream's next message, so both clients raise the same exception for the same failure.

What it does not know: whether a failed call is safe to retry (a ``Generate`` that failed with
UNAVAILABLE may or may not have run on the server), and local argument errors -- those are plain
``ValueError``/``TypeError`` raised before anything is sent.
"""

from __future__ import annotations

from types import TracebackType

import grpc

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "InvalidArgument",
    "Overloaded",
    "PermissionDenied",
    "SpecstreamError",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
    "map_rpc_errors",
]


class SpecstreamError(Exception):
    """A failed specstream RPC. Subclasses narrow it by status code."""

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(details, code)
        self.details: str = details
        self.code: grpc.StatusCode = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.name}, details={self.details!r})"


class InvalidArgument(SpecstreamError):
    """INVALID_ARGUMENT: the server rejected a request field (the message names it)."""


class Overloaded(SpecstreamError):
    """RESOURCE_EXHAUSTED: the server is at capacity; back off and retry later."""


class Unavailable(SpecstreamError):
    """UNAVAILABLE: the server cannot be reached or is shutting down."""


class DeadlineExceeded(SpecstreamError):
    """DEADLINE_EXCEEDED: the call's timeout passed before it finished."""


class Cancelled(SpecstreamError):
    """CANCELLED: the call was cancelled (by this client or by the server)."""


class Unauthenticated(SpecstreamError):
    """UNAUTHENTICATED: the server wants a bearer token (``Client(token=...)``) and got none."""


class PermissionDenied(SpecstreamError):
    """PERMISSION_DENIED: the server refused the token (or the client certificate's name)."""


_BY_CODE: dict[grpc.StatusCode, type[SpecstreamError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def from_rpc_error(err: grpc.RpcError) -> SpecstreamError:
    """Map a ``grpc.RpcError`` (sync or aio) to the SDK's exception for its status code."""
    # A bare RpcError (not a Call) has no code()/details(); treat it as UNKNOWN.
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, SpecstreamError)
    return cls(details or "", code)


class map_rpc_errors:  # noqa: N801 -- a context manager, named like contextlib.suppress
    """``with map_rpc_errors(): ...`` raises ``from_rpc_error(err)`` for a ``grpc.RpcError`` raised
    in the block (``err`` as its ``__cause__``) and lets anything else through unchanged --
    ``asyncio.CancelledError`` included. A plain (not async) context manager, so ``await`` works
    inside it too."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, grpc.RpcError):
            raise from_rpc_error(exc) from exc
