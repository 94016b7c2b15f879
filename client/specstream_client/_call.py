"""One RPC of the ``specstream.v1.Generation`` service as plain data, shared by ``Client`` and
``AsyncClient``: which method (``Rpc``: its name on the stub, and how a response message becomes the
SDK's type), its request, deadline and metadata (``Call``), and the check of a deadline
(``resolve_timeout``).

Contract: ``Call.start(stub)`` makes the call on a ``GenerationStub`` of either kind and returns what
the stub returns -- the response (blocking unary), an awaitable of it (``grpc.aio`` unary), or the
call object to read messages from and cancel (streams). ``Call.parse`` turns one response message
into the SDK's type. The two clients differ only in blocking on or awaiting what ``start`` returns.

What it does not know: channels and event loops (the clients own them), and errors (``errors.py``
maps a failed call to the SDK's exceptions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from specstream_pb import generation_pb2_grpc

from .types import GenerateResult, ModelInfo, StreamChunk

__all__ = [
    "GENERATE",
    "GENERATE_STREAM",
    "GET_MODEL_INFO",
    "Call",
    "R",
    "Rpc",
    "resolve_timeout",
]

R = TypeVar("R")  # the SDK's type a call's response becomes


@dataclass(frozen=True, slots=True)
class Rpc(Generic[R]):
    """A method of the Generation service, as the clients use it."""

    method: str  # the attribute of ``GenerationStub`` that makes the call
    parse: Callable[[Any], R]  # one response message (of a stream: one message) -> the SDK's type


GENERATE: Rpc[GenerateResult] = Rpc("Generate", GenerateResult.from_pb)  # generate() and chat()
GENERATE_STREAM: Rpc[StreamChunk] = Rpc("GenerateStream", StreamChunk.from_pb)  # the *_stream() methods
GET_MODEL_INFO: Rpc[ModelInfo] = Rpc("GetModelInfo", ModelInfo.from_pb)


@dataclass(frozen=True, slots=True)
class Call(Generic[R]):
    """One call of ``rpc``, ready to start on a stub."""

    rpc: Rpc[R]
    request: Message
    timeout: float | None  # the deadline in seconds, checked (``resolve_timeout``); None: none
    metadata: tuple[tuple[str, str], ...] | None  # sent with the call (the bearer token); None: nothing

    def start(self, stub: generation_pb2_grpc.GenerationStub) -> Any:
        """Makes the call on ``stub`` (over a blocking or a ``grpc.aio`` channel) and returns what the
        stub's method returns: see the module docstring."""
        return getattr(stub, self.rpc.method)(self.request, timeout=self.timeout, metadata=self.metadata)

    def parse(self, message: Any) -> R:
        return self.rpc.parse(message)


def resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    """A call's deadline in seconds: ``timeout``, or ``default`` when it is None; None: no deadline.
    ``TypeError`` for a value that is not a number, ``ValueError`` for one <= 0."""
    value = default if timeout is None else timeout
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"timeout must be a number of seconds or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value!r}")
    return float(value)
