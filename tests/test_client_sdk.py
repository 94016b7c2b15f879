"""The client SDK against an in-process fake Generation service: request building, result
conversion, error mapping (unary and streaming, also mid-stream), deadlines, AsyncClient, and
importing without torch."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from specstream_client import (
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    GenerateResult,
    InvalidArgument,
    ModelInfo,
    Overloaded,
    SpecstreamError,
    StreamChunk,
    Unavailable,
)
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc

C = common_pb2

_RESPONSE = generation_pb2.GenerateResponse(
    request_id="req-1",
    text="Hello world",
    token_ids=[10, 11, 12],
    finish_reason=C.FINISH_REASON_LENGTH,
    usage=C.Usage(prompt_tokens=5, completion_tokens=3),
    stats=C.SpeculationStats(draft_tokens=8, accepted_tokens=6, target_passes=3, mean_accepted_length=2.5),
    timings=C.Timings(queue_seconds=0.01, time_to_first_token_seconds=0.05, total_seconds=0.2),
)

_CHUNKS = [
    generation_pb2.GenerateStreamResponse(request_id="req-1", text="Hel", token_ids=[10]),
    generation_pb2.GenerateStreamResponse(request_id="req-1", text="lo", token_ids=[11]),
    generation_pb2.GenerateStreamResponse(
        request_id="req-1",
        text=" world",
        token_ids=[12],
        finish_reason=C.FINISH_REASON_STOP,
        usage=C.Usage(prompt_tokens=5, completion_tokens=3),
        stats=C.SpeculationStats(draft_tokens=4, accepted_tokens=1, target_passes=3, mean_accepted_length=1.5),
        timings=C.Timings(queue_seconds=0.02, time_to_first_token_seconds=0.04, total_seconds=0.3),
    ),
]

_MODEL_INFO = generation_pb2.ModelInfo(
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
        self.chunks: list[generation_pb2.GenerateStreamResponse] = list(_CHUNKS)
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.abort_after = 0  # stream chunks sent before aborting
        self.delay = 0.0  # seconds before responding / between chunks
        self.finished = threading.Event()  # the RPC ended (completed, failed or cancelled)

    def _sleep(self, context: grpc.ServicerContext) -> None:
        # Poll so a handler outliving its client's deadline ends promptly.
        end = time.monotonic() + self.delay
        while time.monotonic() < end and context.is_active():
            time.sleep(0.01)

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(request)
        context.add_callback(self.finished.set)
        self._sleep(context)
        if self.abort is not None:
            context.abort(*self.abort)
        return _RESPONSE

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
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
        if self.abort is not None:
            context.abort(*self.abort)
        return _MODEL_INFO


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeGeneration, str]]:
    servicer = FakeGeneration()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(grace=None)


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


# --- request building ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speculation", "mode", "gamma"),
    [
        ("auto", C.SPECULATION_MODE_AUTO, 0),
        ("off", C.SPECULATION_MODE_OFF, 0),
        (0, C.SPECULATION_MODE_OFF, 0),
        (1, C.SPECULATION_MODE_FIXED, 1),
        (7, C.SPECULATION_MODE_FIXED, 7),
        (1000, C.SPECULATION_MODE_FIXED, 1000),  # above any server max: the server rejects it
    ],
)
def test_speculation_mapping(client: Client, fake: FakeGeneration, speculation: Any, mode: int, gamma: int) -> None:
    client.generate("hi", speculation=speculation)
    req = fake.requests[-1]
    assert req.speculation.mode == mode
    assert req.speculation.gamma == gamma


@pytest.mark.parametrize("bad", [True, False, -1, "fast", "AUTO", 2.0, None, [2], 2**32])
def test_invalid_speculation_raises_before_sending(client: Client, fake: FakeGeneration, bad: Any) -> None:
    with pytest.raises(ValueError, match="speculation") as info:
        client.generate("hi", speculation=bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="speculation"):
        client.generate_stream("hi", speculation=bad)
    assert fake.requests == []


def test_request_fields(client: Client, fake: FakeGeneration) -> None:
    client.generate(
        "Once upon",
        max_new_tokens=17,
        stop="\n",
        stop_token_ids=[2, 3],
        ignore_eos=True,
        request_id="my-id",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    req = fake.requests[-1]
    assert req.WhichOneof("input") == "prompt"
    assert req.prompt == "Once upon"
    assert req.max_new_tokens == 17
    assert list(req.stop) == ["\n"]
    assert list(req.stop_token_ids) == [2, 3]
    assert req.ignore_eos is True
    assert req.request_id == "my-id"
    assert req.traceparent.startswith("00-0af7")


def test_request_defaults_and_token_prompt(client: Client, fake: FakeGeneration) -> None:
    client.generate([5, 6, 7])
    req = fake.requests[-1]
    assert req.WhichOneof("input") == "prompt_token_ids"
    assert list(req.prompt_token_ids.ids) == [5, 6, 7]
    assert req.max_new_tokens == 64
    assert list(req.stop) == [] and list(req.stop_token_ids) == []
    assert req.ignore_eos is False and req.request_id == "" and req.traceparent == ""
    assert req.speculation.mode == C.SPECULATION_MODE_AUTO

    client.generate((), stop=["a", "bc"])
    req = fake.requests[-1]
    assert req.WhichOneof("input") == "prompt_token_ids"  # empty list still picks the oneof
    assert list(req.prompt_token_ids.ids) == []
    assert list(req.stop) == ["a", "bc"]

    client.generate("")
    assert fake.requests[-1].WhichOneof("input") == "prompt"


@pytest.mark.parametrize("max_new_tokens", [0, -5, 100_000])
def test_max_new_tokens_sent_as_given(client: Client, fake: FakeGeneration, max_new_tokens: int) -> None:
    client.generate("x", max_new_tokens=max_new_tokens)
    assert fake.requests[-1].max_new_tokens == max_new_tokens


def test_local_type_errors(client: Client, fake: FakeGeneration) -> None:
    with pytest.raises(TypeError):
        client.generate(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        client.generate([1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prompt"):
        client.generate([1, -2])
    with pytest.raises(TypeError):
        client.generate("x", stop=[1])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        client.generate("x", max_new_tokens="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_new_tokens"):
        client.generate("x", max_new_tokens=2**31)
    with pytest.raises(ValueError, match="timeout"):
        client.generate("x", timeout=0)
    assert fake.requests == []


def test_url_forms(url: str, fake: FakeGeneration) -> None:
    with Client(f"grpc://{url}") as c:
        assert c.generate("hi").text == "Hello world"
    for bad in ("http://localhost:1", "", "grpc://"):
        with pytest.raises(ValueError):
            Client(bad)


# --- results -------------------------------------------------------------------------------------------


def test_generate_result(client: Client, fake: FakeGeneration) -> None:
    res = client.generate("hi")
    assert isinstance(res, GenerateResult)
    assert res.request_id == "req-1"
    assert res.text == "Hello world"
    assert res.token_ids == [10, 11, 12]
    assert res.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (5, 3)
    assert res.stats.draft_tokens == 8 and res.stats.accepted_tokens == 6
    assert res.stats.target_passes == 3 and res.stats.mean_accepted_length == 2.5
    assert res.stats.acceptance_rate == 0.75
    assert res.timings.queue_seconds == pytest.approx(0.01)
    assert res.timings.time_to_first_token_seconds == pytest.approx(0.05)
    assert res.timings.total_seconds == pytest.approx(0.2)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["stats"]["acceptance_rate"] == 0.75
    assert d["finish_reason"] == "length" and d["token_ids"] == [10, 11, 12]


def test_finish_reasons_and_missing_fields() -> None:
    names = {
        C.FINISH_REASON_LENGTH: "length",
        C.FINISH_REASON_STOP: "stop",
        C.FINISH_REASON_EOS: "eos",
        C.FINISH_REASON_CANCELLED: "cancelled",
        C.FINISH_REASON_ERROR: "error",
        C.FINISH_REASON_UNSPECIFIED: "unspecified",
    }
    for value, name in names.items():
        assert GenerateResult.from_pb(generation_pb2.GenerateResponse(finish_reason=value)).finish_reason == name
    empty = GenerateResult.from_pb(generation_pb2.GenerateResponse())
    assert empty.stats.acceptance_rate == 0.0  # no drafts: 0, not ZeroDivisionError
    assert empty.usage.completion_tokens == 0
    chunk = StreamChunk.from_pb(generation_pb2.GenerateStreamResponse(text="x"))
    assert chunk.finish_reason is None and chunk.usage is None and not chunk.is_final


def test_model_info(client: Client, fake: FakeGeneration) -> None:
    info = client.model_info()
    assert isinstance(info, ModelInfo)
    assert info.target_model == "tiny-target" and info.draft_model == "tiny-draft"
    assert info.vocab_size == 320 and info.max_context_length == 2048
    assert info.max_new_tokens_limit == 512 and info.max_gamma == 8 and info.default_gamma == 4
    assert info.eos_token_ids == [1, 2]
    assert info.running_sequences == 3 and info.queued_sequences == 1 and info.free_slots == 5
    assert info.draft_sequences == 3 and info.draft_connected is True and info.gateway_in_flight == 4
    json.dumps(info.to_dict())


def test_stream_chunks(client: Client, fake: FakeGeneration) -> None:
    chunks = list(client.generate_stream("hi", stop=["\n"], speculation=3))
    assert [c.text for c in chunks] == ["Hel", "lo", " world"]
    assert [c.token_ids for c in chunks] == [[10], [11], [12]]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert chunks[0].usage is None and chunks[0].stats is None and chunks[0].timings is None
    last = chunks[-1]
    assert last.is_final
    assert last.usage is not None and last.usage.completion_tokens == 3
    assert last.stats is not None and last.stats.acceptance_rate == 0.25
    assert last.timings is not None and last.timings.total_seconds == pytest.approx(0.3)
    assert fake.requests[-1].speculation.mode == C.SPECULATION_MODE_FIXED
    json.dumps([c.to_dict() for c in chunks])


def test_stream_starts_lazily_and_break_cancels(client: Client, fake: FakeGeneration) -> None:
    fake.chunks = list(_CHUNKS) * 40
    fake.delay = 0.05  # 6 s of chunks if nobody cancels
    stream = client.generate_stream("hi")
    time.sleep(0.05)
    assert fake.requests == []  # nothing sent before iteration
    for _ in stream:
        break
    stream.close()
    assert fake.finished.wait(1.5)
    # Dropping an unfinished stream cancels it too.
    fake.finished.clear()
    for _ in client.generate_stream("hi"):
        break
    assert fake.finished.wait(1.5)


# --- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "cls"), ERROR_CASES)
def test_unary_error_mapping(client: Client, fake: FakeGeneration, code: grpc.StatusCode, cls: type) -> None:
    fake.abort = (code, f"bad thing: {code.name.lower()}")
    with pytest.raises(SpecstreamError) as info:
        client.generate("hi")
    check_error(info.value, code, cls, f"bad thing: {code.name.lower()}")
    with pytest.raises(cls):
        client.model_info()


@pytest.mark.parametrize(("code", "cls"), ERROR_CASES)
def test_stream_error_mapping(client: Client, fake: FakeGeneration, code: grpc.StatusCode, cls: type) -> None:
    fake.abort = (code, "max_new_tokens must be <= 512, got 9999")
    with pytest.raises(SpecstreamError) as info:
        list(client.generate_stream("hi"))
    check_error(info.value, code, cls, "max_new_tokens must be <= 512, got 9999")


@pytest.mark.parametrize(("code", "cls"), ERROR_CASES[:3])
def test_stream_error_after_first_chunk(client: Client, fake: FakeGeneration, code: grpc.StatusCode, cls: type) -> None:
    fake.abort = (code, "target lost")
    fake.abort_after = 1
    got: list[StreamChunk] = []
    stream = client.generate_stream("hi")
    with pytest.raises(SpecstreamError) as info:
        for chunk in stream:
            got.append(chunk)
    assert [c.text for c in got] == ["Hel"]
    check_error(info.value, code, cls, "target lost")
    assert list(stream) == []  # a failed stream stays finished


def test_deadline_unary_and_stream(url: str, client: Client, fake: FakeGeneration) -> None:
    fake.delay = 2.0
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        client.generate("hi", timeout=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(DeadlineExceeded):
        list(client.generate_stream("hi", timeout=0.2))
    with Client(url, timeout=0.2) as c:  # the client-wide default applies too
        with pytest.raises(DeadlineExceeded):
            c.generate("hi")
    assert time.monotonic() - t0 < 1.8


def test_unreachable_server_is_unavailable() -> None:
    with Client(f"127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(Unavailable) as info:
            c.generate("hi")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(Unavailable):
            list(c.generate_stream("hi"))


def test_errors_pickle_and_repr() -> None:
    import pickle

    err = Overloaded("queue full", grpc.StatusCode.RESOURCE_EXHAUSTED)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is Overloaded and back.details == "queue full"
    assert back.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err) == "RESOURCE_EXHAUSTED: queue full"
    assert "queue full" in repr(err)


# --- AsyncClient ------------------------------------------------------------------------------------------


def test_async_generate_stream_and_info(url: str, fake: FakeGeneration) -> None:
    client = AsyncClient(url)  # built outside any event loop: the channel is made lazily

    async def main() -> None:
        async with client as c:
            res = await c.generate([1, 2], speculation="off", stop="x", max_new_tokens=9)
            assert res.text == "Hello world" and res.finish_reason == "length"
            assert res.stats.acceptance_rate == 0.75
            req = fake.requests[-1]
            assert req.speculation.mode == C.SPECULATION_MODE_OFF
            assert list(req.prompt_token_ids.ids) == [1, 2] and list(req.stop) == ["x"]
            assert req.max_new_tokens == 9

            chunks = [chunk async for chunk in c.generate_stream("hi", speculation=2)]
            assert [ch.text for ch in chunks] == ["Hel", "lo", " world"]
            assert chunks[-1].finish_reason == "stop" and chunks[-1].usage is not None
            assert fake.requests[-1].speculation.gamma == 2

            info = await c.model_info()
            assert info.max_gamma == 8

            with pytest.raises(ValueError, match="speculation"):
                c.generate_stream("hi", speculation=-3)
            with pytest.raises(ValueError, match="speculation"):
                await c.generate("hi", speculation=True)

    asyncio.run(main())
    with pytest.raises(RuntimeError):
        asyncio.run(client.generate("hi"))


@pytest.mark.parametrize(("code", "cls"), ERROR_CASES)
def test_async_error_mapping(url: str, fake: FakeGeneration, code: grpc.StatusCode, cls: type) -> None:
    fake.abort = (code, "nope")

    async def main() -> None:
        async with AsyncClient(url) as c:
            with pytest.raises(SpecstreamError) as info:
                await c.generate("hi")
            check_error(info.value, code, cls, "nope")
            with pytest.raises(SpecstreamError) as info:
                async for _ in c.generate_stream("hi"):
                    pass
            check_error(info.value, code, cls, "nope")
            with pytest.raises(cls):
                await c.model_info()

    asyncio.run(main())


def test_async_error_after_first_chunk_and_deadline(url: str, fake: FakeGeneration) -> None:
    async def main() -> None:
        async with AsyncClient(url) as c:
            fake.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "evicted")
            fake.abort_after = 1
            got: list[str] = []
            with pytest.raises(Overloaded, match="evicted"):
                async for chunk in c.generate_stream("hi"):
                    got.append(chunk.text)
            assert got == ["Hel"]

            fake.reset()
            fake.delay = 2.0
            with pytest.raises(DeadlineExceeded):
                await c.generate("hi", timeout=0.2)
            with pytest.raises(DeadlineExceeded):
                async for _ in c.generate_stream("hi", timeout=0.2):
                    pass
        async with AsyncClient(url, timeout=0.2) as c:
            with pytest.raises(DeadlineExceeded):
                await c.generate("hi")

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 1.8


def test_async_stream_close_cancels(url: str, fake: FakeGeneration) -> None:
    fake.chunks = list(_CHUNKS) * 40
    fake.delay = 0.05

    async def main() -> None:
        async with AsyncClient(url) as c:
            async with c.generate_stream("hi") as stream:
                async for _ in stream:
                    break
            assert await asyncio.to_thread(fake.finished.wait, 1.5)

    asyncio.run(main())


def test_async_unreachable_is_unavailable() -> None:
    async def main() -> None:
        async with AsyncClient(f"grpc://127.0.0.1:{free_port()}", timeout=5) as c:
            with pytest.raises(Unavailable):
                await c.generate("hi")

    asyncio.run(main())


# --- packaging -------------------------------------------------------------------------------------------


def test_sdk_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import specstream_client\n"
        "from specstream_client import Client, AsyncClient, GenerateResult, SpecstreamError\n"
        "import specstream_client.aio, specstream_client.client, specstream_client.types\n"
        "c = Client('127.0.0.1:1'); c.close()\n"
        "heavy = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split('.')[0] in "
        "('torch', 'numpy', 'tokenizers', 'specstream', 'gateway', 'target_service', 'draft_service'))\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
