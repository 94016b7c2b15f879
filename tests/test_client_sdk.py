"""The client SDK (Client) against an in-process fake Generation service
(tests/support/fake_generation.py): request building, result conversion, error mapping (unary and
streaming, also mid-stream) and deadlines. AsyncClient, the CLI, beam search and chat:
tests/test_client_sdk_async.py."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest

from tests.support.fake_generation import (  # noqa: F401 (server, fake, url, client: fixtures)
    CHUNKS,
    ERROR_CASES,
    C,
    FakeGeneration,
    check_error,
    client,
    fake,
    free_port,
    server,
    url,
)

from specstream_client import (
    Client,
    DeadlineExceeded,
    GenerateResult,
    Logprob,
    ModelInfo,
    Overloaded,
    SpecstreamError,
    StreamChunk,
    TokenLogprob,
    Unavailable,
)
from specstream_pb import generation_pb2


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
    # Greedy, no logprobs; top_p and seed unset (not 0) so the server applies its defaults.
    assert req.temperature == 0.0 and req.top_k == 0
    assert not req.HasField("top_p") and not req.HasField("seed")
    assert req.logprobs is False and req.top_logprobs == 0

    client.generate((), stop=["a", "bc"])
    req = fake.requests[-1]
    assert req.WhichOneof("input") == "prompt_token_ids"  # empty list still picks the oneof
    assert list(req.prompt_token_ids.ids) == []
    assert list(req.stop) == ["a", "bc"]

    client.generate("")
    assert fake.requests[-1].WhichOneof("input") == "prompt"


def test_sampling_request_fields(client: Client, fake: FakeGeneration) -> None:
    client.generate("x", temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1, logprobs=True, top_logprobs=5)
    req = fake.requests[-1]
    assert req.temperature == pytest.approx(0.7)
    assert req.top_k == 40 and req.top_p == pytest.approx(0.9)
    assert req.HasField("seed") and req.seed == 2**64 - 1
    assert req.logprobs is True and req.top_logprobs == 5
    client.generate_stream("x", temperature=1, seed=0, top_p=1.0).close()  # built eagerly, sent never
    client.generate("x", seed=0, top_p=1)
    req = fake.requests[-1]
    assert req.HasField("seed") and req.seed == 0  # 0 is a seed, not "unset"
    assert req.HasField("top_p") and req.top_p == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        # Ranges are the server's to check: sent as given.
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_logprobs=-1),
        dict(top_logprobs=10_000),
        dict(top_logprobs=3),  # without logprobs=True
    ],
)
def test_sampling_ranges_sent_as_given(client: Client, fake: FakeGeneration, kwargs: dict[str, Any]) -> None:
    client.generate("x", **kwargs)
    req = fake.requests[-1]
    for name, value in kwargs.items():
        sent = getattr(req, name)
        assert sent == value or (value != value and sent != sent), (name, value, sent)  # NaN != NaN


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed="7"), TypeError, "seed"),
        (dict(seed=True), TypeError, "seed"),
        (dict(top_k=2**31), ValueError, "top_k"),
        (dict(top_k=-(2**31) - 1), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(top_logprobs=2**31), ValueError, "top_logprobs"),
        (dict(top_logprobs=None), TypeError, "top_logprobs"),
        (dict(temperature="0.5"), TypeError, "temperature"),
        (dict(temperature=None), TypeError, "temperature"),
        (dict(top_p="1"), TypeError, "top_p"),
        (dict(logprobs=1), TypeError, "logprobs"),
    ],
)
def test_unencodable_sampling_args_raise_before_sending(
    client: Client, fake: FakeGeneration, kwargs: dict[str, Any], exc: type, needle: str
) -> None:
    (value,) = kwargs.values()
    with pytest.raises(exc, match=needle) as info:
        client.generate("x", **kwargs)
    if exc is ValueError:
        assert str(value) in str(info.value)  # names the value too
    with pytest.raises(exc, match=needle):
        client.generate_stream("x", **kwargs)
    assert fake.requests == []


def test_numpy_style_ints_are_accepted(client: Client, fake: FakeGeneration) -> None:
    class Index:  # what numpy integers provide
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    client.generate("x", seed=Index(123), top_k=Index(4), top_logprobs=Index(2), logprobs=True)
    req = fake.requests[-1]
    assert (req.seed, req.top_k, req.top_logprobs) == (123, 4, 2)


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
    assert res.seed == 2**64 - 3
    assert [lp.token_id for lp in res.logprobs] == res.token_ids
    assert res.logprobs[0] == TokenLogprob(10, -0.5, (Logprob(10, -0.5), Logprob(7, -1.25)))
    assert res.logprobs[1] == TokenLogprob(11, -0.25) and res.logprobs[1].top == ()
    with pytest.raises(AttributeError):
        res.logprobs[0].logprob = 0.0  # type: ignore[misc]
    d = json.loads(json.dumps(res.to_dict()))
    assert d["stats"]["acceptance_rate"] == 0.75
    assert d["finish_reason"] == "length" and d["token_ids"] == [10, 11, 12]
    assert d["seed"] == 2**64 - 3
    assert d["logprobs"][0] == {"token_id": 10, "logprob": -0.5,
                                "top": [{"token_id": 10, "logprob": -0.5}, {"token_id": 7, "logprob": -1.25}]}
    assert len(d["logprobs"]) == 3


def test_result_without_logprobs() -> None:
    res = GenerateResult.from_pb(generation_pb2.GenerateResponse(token_ids=[1, 2], seed=9))
    assert res.logprobs == [] and res.seed == 9
    d = res.to_dict()
    assert "logprobs" not in d and d["seed"] == 9
    chunk = StreamChunk.from_pb(generation_pb2.GenerateStreamResponse(token_ids=[1], seed=9))
    assert chunk.logprobs == [] and chunk.seed is None  # not final: no seed yet
    assert "logprobs" not in chunk.to_dict()


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
    assert [c.seed for c in chunks] == [None, None, 0]
    assert [[lp.token_id for lp in c.logprobs] for c in chunks] == [c.token_ids for c in chunks]
    assert [c.logprobs[0].logprob for c in chunks] == [-0.5, -0.25, -2.0]
    last = chunks[-1]
    assert last.is_final
    assert last.usage is not None and last.usage.completion_tokens == 3
    assert last.stats is not None and last.stats.acceptance_rate == 0.25
    assert last.timings is not None and last.timings.total_seconds == pytest.approx(0.3)
    assert fake.requests[-1].speculation.mode == C.SPECULATION_MODE_FIXED
    dicts = json.loads(json.dumps([c.to_dict() for c in chunks]))
    assert dicts[-1]["seed"] == 0 and dicts[0]["seed"] is None
    assert dicts[0]["logprobs"] == [{"token_id": 10, "logprob": -0.5, "top": []}]


def test_stream_starts_lazily_and_break_cancels(client: Client, fake: FakeGeneration) -> None:
    fake.chunks = list(CHUNKS) * 40
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
    fake.delay = 30.0  # the handler polls its context: it ends with the deadline
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        client.generate("hi", timeout=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(DeadlineExceeded):
        list(client.generate_stream("hi", timeout=0.2))
    with Client(url, timeout=0.2) as c:  # the client-wide default applies too
        with pytest.raises(DeadlineExceeded):
            c.generate("hi")
    assert time.monotonic() - t0 < 10  # each call ended at its 0.2 s deadline, not the server's 30 s


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
