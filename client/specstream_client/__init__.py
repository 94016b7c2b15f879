"""Python client SDK for specstream, a speculative-decoding LLM inference service.

Contract: ``Client`` (blocking) and ``AsyncClient`` (asyncio) talk to the gateway's
``specstream.v1.Generation`` gRPC service and return plain dataclasses (``GenerateResult``,
``StreamChunk``, ``ModelInfo``); failed RPCs raise ``SpecstreamError`` subclasses. TLS, client
certificates and bearer tokens are keywords of both clients (``tls_ca``, ``tls_cert``, ``tls_key``,
``server_name``, ``token``). Every
generate/chat call takes the options that ``GenerateOptions`` defines, as keywords or as one
object. Depends on grpcio and protobuf only -- importing it never imports torch or the server
packages.

What it does not know: tokenization (the server tokenizes text prompts), the server's limits
(ask ``model_info()``), and retry policy (it never retries).
"""

from __future__ import annotations

from .aio import AsyncClient, AsyncResponseStream
from .client import Client, ResponseStream
from .errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    SpecstreamError,
    Unauthenticated,
    Unavailable,
)
from .options import GenerateOptions, GenerateOptionsDict
from .types import (
    BeamSequence,
    GenerateResult,
    Logprob,
    ModelInfo,
    Sample,
    SpeculationStats,
    StreamChunk,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncResponseStream",
    "BeamSequence",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "GenerateOptions",
    "GenerateOptionsDict",
    "GenerateResult",
    "InvalidArgument",
    "Logprob",
    "ModelInfo",
    "Overloaded",
    "PermissionDenied",
    "ResponseStream",
    "Sample",
    "SpecstreamError",
    "SpeculationStats",
    "StreamChunk",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]

__version__ = "0.1.0"
