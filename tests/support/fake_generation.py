"""The client SDK tests' fake Generation service (in process, on a loopback port, recording what
it is sent and answering with fixed replies or a scripted error), its pytest fixtures (`server`,
`fake`, `url`, `client`) and the error cases every kind of call is checked against."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.support.fake_gateway import serve_generation

from specstream_client import (
    Cancelled,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    SpecstreamError,
    Unavailable,
)
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc


C = common_pb2

RESPONSE = generation_pb2.GenerateResponse(
    request_id="req-1",
    text="Hello world",
    token_ids=[10, 11, 12],
    finish_reason=C.FINISH_REASON_LENGTH,
    usage=C.Usage(prompt_tokens=5, completion_tokens=3),
    stats=C.SpeculationStats(draft_tokens=8, accepted_tokens=6, target_passes=3, mean_accepted_length=2.5),
    timings=C.Timings(queue_seconds=0.01, time_to_first_token_seconds=0.05, total_seconds=0.2),
    seed=2**64 - 3,
    logprobs=[
        C.TokenLogprob(token_id=10, logprob=-0.5, top=[C.Logprob(token_id=10, logprob=-0.5),
                                                       C.Logprob(token_id=7, logprob=-1.25)]),
        C.TokenLogprob(token_id=11, logprob=-0.25),
        C.TokenLogprob(token_id=12, logprob=-2.0),
    ],
)

CHUNKS = [
    generation_pb2.GenerateStreamResponse(request_id="req-1", text="Hel", token_ids=[10],
                                          logprobs=[C.TokenLogprob(token_id=10, logprob=-0.5)]),
    generation_pb2.GenerateStreamResponse(request_id="req-1", text="lo", token_ids=[11],
                                          logprobs=[C.TokenLogprob(token_id=11, logprob=-0.25)]),
    generation_pb2.GenerateStreamResponse(
        request_id="req-1",
        text=" world",
        token_ids=[12],
        logprobs=[C.TokenLogprob(token_id=12, logprob=-2.0)],
        seed=0,  # a real seed: the final chunk must report 0, not None
        finish_reason=C.FINISH_REASON_STOP,
        usage=C.Usage(prompt_tokens=5, completion_tokens=3),
        stats=C.SpeculationStats(draft_tokens=4, accepted_tokens=1, target_passes=3, mean_accepted_length=1.5),
        timings=C.Timings(queue_seconds=0.02, time_to_first_token_seconds=0.04, total_seconds=0.3),
    ),
]

MODEL_INFO = generation_pb2.ModelInfo(
    target_model="tiny-target",
    draft_model="tiny-draft",
    vocab_size=320,
    max_context_length=2048,
    max_new_tokens_limit=512,
    max_gamma=8,
    default_gamma=4,
    eos_token_ids=[1, 2],
    running_sequences=3,
    queued_sequences=1,
    free_slots=5,
    draft_sequences=3,
    draft_connected=True,
    gateway_in_flight=4,
)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Records requests; returns canned responses or aborts with a chosen status."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.response: generation_pb2.GenerateResponse = RESPONSE
        self.chunks: list[generation_pb2.GenerateStreamResponse] = list(CHUNKS)
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.abort_after = 0  # stream chunks sent before aborting
        self.delay = 0.0  # seconds before responding / between chunks
        self.finished = threading.Event()  # the RPC ended (completed, failed or cancelled)
        # Every call, model info's too: (method, its authorization metadata, seconds left to its deadline).
        self.calls: list[tuple[str, str | None, float | None]] = []

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        sent = dict(context.invocation_metadata())
        self.calls.append((method, sent.get("authorization"), context.time_remaining()))

    def _sleep(self, context: grpc.ServicerContext) -> None:
        # Poll so a handler outliving its client's deadline ends promptly.
        end = time.monotonic() + self.delay
        while time.monotonic() < end and context.is_active():
            time.sleep(0.01)

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("Generate", context)
        self.requests.append(request)
        context.add_callback(self.finished.set)
        self._sleep(context)
        if self.abort is not None:
            context.abort(*self.abort)
        return self.response

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._record("GenerateStream", context)
        self.requests.append(request)
        context.add_callback(self.finished.set)
        for i, chunk in enumerate(self.chunks):
            if self.abort is not None and i == self.abort_after:
                context.abort(*self.abort)
            self._sleep(context)
            if not context.is_active():
                return
            yield chunk
        if self.abort is not None:
            context.abort(*self.abort)

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("GetModelInfo", context)
        if self.abort is not None:
            context.abort(*self.abort)
        return MODEL_INFO


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeGeneration, str]]:
    servicer = FakeGeneration()
    with serve_generation(servicer, workers=8) as address:
        yield servicer, address


@pytest.fixture
def fake(server: tuple[FakeGeneration, str]) -> FakeGeneration:
    server[0].reset()
    return server[0]


@pytest.fixture
def url(server: tuple[FakeGeneration, str]) -> str:
    return server[1]


@pytest.fixture
def client(url: str) -> Iterator[Client]:
    with Client(url) as c:
        yield c


ERROR_CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, SpecstreamError),
    (grpc.StatusCode.NOT_FOUND, SpecstreamError),
]


def check_error(err: BaseException, code: grpc.StatusCode, cls: type[SpecstreamError], message: str) -> None:
    assert type(err) is cls
    assert isinstance(err, SpecstreamError)
    assert err.code == code
    assert err.details == message
    assert message in str(err)
    assert isinstance(err.__cause__, grpc.RpcError)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
