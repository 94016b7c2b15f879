"""A Generation servicer of a test's own on a loopback port, for SDK and CLI tests without a stack."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from specstream_pb import generation_pb2_grpc


@contextmanager
def serve_generation(servicer, workers: int = 4) -> Iterator[str]:
    """Serves `servicer` until the block ends; yields its "127.0.0.1:port"."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
