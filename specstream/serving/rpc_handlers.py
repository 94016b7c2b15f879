"""Rebuilding a grpc method handler around wrappers: how a server interceptor runs code around a
method without caring whether its requests and responses stream.

Knows nothing about what the wrappers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]  # (request or request iterator, context) -> response, or an async iterator of them

_KINDS = {  # (request_streaming, response_streaming) -> the handler's attribute, its factory, whether it streams out
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
}


def rewrap(handler: grpc.RpcMethodHandler, wrap_unary: Callable[[Behavior], Behavior],
           wrap_stream: Callable[[Behavior], Behavior],
           request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """`handler` with its behavior passed through `wrap_stream` when it streams responses, else
    through `wrap_unary`; the same serializer, and the same request deserializer unless one is given."""
    attr, make, streams_out = _KINDS[(handler.request_streaming, handler.response_streaming)]
    wrap = wrap_stream if streams_out else wrap_unary
    return make(wrap(getattr(handler, attr)), request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)
