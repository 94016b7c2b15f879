"""The reliability commands' shared part: a stack of their own on the chosen models (or the
addresses of a running one), and where their figures go (a table on stdout, JSON in --out)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from tools.launcher import Stack, StackSpec


@dataclass(frozen=True)
class Addresses:
    grpc: str  # the gateway's gRPC address
    http: str | None  # its OpenAI-compatible HTTP address
    stack: Stack | None = None  # when the command started it


@contextlib.contextmanager
def gateway_of(models, gateway: str | None, http: str | None, max_new_tokens_limit: int | None = None,
               **spec) -> Iterator[Addresses]:
    """The running gateway at `gateway` (and `http`), or a stack started on `models` (a
    tools.bench.models.BenchModels) with an HTTP front, stopped at the end."""
    if gateway is not None:
        yield Addresses(gateway, http)
        return
    extra = ["--max-new-tokens-limit", str(max_new_tokens_limit)] if max_new_tokens_limit else []
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
            str(models.target), str(models.draft) if models.draft else None, dtype=models.dtype,
            weights=models.weights, http_port=0, log_dir=logs, extra_gateway_args=extra,
            **(models.proposing if models.draft else {}), **spec)) as stack:
        yield Addresses(stack.gateway_address, stack.http_address, stack)
