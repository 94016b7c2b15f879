"""The client SDK against an in-process fake Generation service (tests/support/fake_generation.py):
AsyncClient (the same calls, results and errors as Client), the `specstream generate` flags that
reach the request (the beam flags and the n-best list it prints too), beam search's n-best
`sequences`, chat, and importing without torch."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
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
    AsyncClient,
    BeamSequence,
    Client,
    DeadlineExceeded,
    GenerateOptions,
    ModelInfo,
    Overloaded,
    SpecstreamError,
    StreamChunk,
    Unavailable,
)
from specstream_pb import generation_pb2


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
            assert res.seed == 2**64 - 3 and len(res.logprobs) == 3

            await c.generate("hi", temperature=0.5, top_k=3, top_p=0.5, seed=11, logprobs=True, top_logprobs=2)
            req = fake.requests[-1]
            assert (req.temperature, req.top_k, req.top_p, req.seed) == (0.5, 3, 0.5, 11)
            assert req.logprobs is True and req.top_logprobs == 2

            chunks = [chunk async for chunk in c.generate_stream("hi", speculation=2, temperature=1.0, seed=5)]
            assert [ch.text for ch in chunks] == ["Hel", "lo", " world"]
            assert chunks[-1].finish_reason == "stop" and chunks[-1].usage is not None
            assert chunks[-1].seed == 0 and [len(ch.logprobs) for ch in chunks] == [1, 1, 1]
            assert fake.requests[-1].speculation.gamma == 2
            assert fake.requests[-1].temperature == 1.0 and fake.requests[-1].seed == 5

            with pytest.raises(ValueError, match="seed"):
                c.generate_stream("hi", seed=-1)
            with pytest.raises(ValueError, match="seed"):
                await c.generate("hi", seed=2**64)

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
            fake.delay = 30.0
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
    assert time.monotonic() - t0 < 10


def test_async_stream_close_cancels(url: str, fake: FakeGeneration) -> None:
    fake.chunks = list(CHUNKS) * 40
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


# --- the `specstream generate` CLI ---------------------------------------------------------------------


def test_cli_generate_sampling_flags(url: str, fake: FakeGeneration, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    flags = ["--temperature", "0.5", "--top-k", "7", "--top-p", "0.75", "--seed", "42", "--logprobs", "3"]
    assert main(["generate", "--url", url, "--json", *flags, "hi"]) == 0
    req = fake.requests[-1]
    assert (req.temperature, req.top_k, req.top_p, req.seed) == (0.5, 7, 0.75, 42)
    assert req.logprobs is True and req.top_logprobs == 3
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 2**64 - 3 and [lp["token_id"] for lp in out["logprobs"]] == [10, 11, 12]

    assert main(["generate", "--url", url, "--logprobs", "0", "hi"]) == 0  # logprobs, no alternatives
    req = fake.requests[-1]
    assert req.logprobs is True and req.top_logprobs == 0
    assert req.temperature == 0.0 and not req.HasField("seed") and not req.HasField("top_p")

    assert main(["generate", "--url", url, "hi"]) == 0  # no --logprobs: none asked for
    assert fake.requests[-1].logprobs is False
    out = capsys.readouterr()
    assert out.out.startswith("Hello world") and "seed" not in out.err  # greedy: no seed to report
    assert main(["generate", "--url", url, "--temperature", "0.5", "hi"]) == 0
    assert f"seed {2**64 - 3}" in capsys.readouterr().err  # sampled: the seed reproduces it

    assert main(["generate", "--url", url, "--stream", "--json", "--temperature", "1", "hi"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["seed"] == 0 and lines[0]["seed"] is None

    for bad in (["--seed", "-1"], ["--seed", str(2**64)], ["--logprobs", "-1"], ["--top-k", "-2"]):
        with pytest.raises(SystemExit):
            main(["generate", "--url", url, *bad, "hi"])
        assert bad[0] in capsys.readouterr().err


def test_cli_constraint_flags(url: str, fake: FakeGeneration, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json-schema and --grammar read their file, --regex, --choice (repeated) and --json-object go
    on the request as its constraint; two at once, or a file that is not there, are refused."""
    from tools.cli import main

    schema = tmp_path / "person.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}}')
    grammar = tmp_path / "yes.lark"
    grammar.write_text('start: "yes" | "no"')
    cases = [(["--json-schema", str(schema)], "json_schema", schema.read_text()),
             (["--grammar", str(grammar)], "grammar", grammar.read_text()),
             (["--regex", "[0-9]+"], "regex", "[0-9]+"),
             (["--json-object"], "json_object", True)]
    for flags, kind, value in cases:
        assert main(["chat", "--url", url, *flags, "hi"]) == 0
        req = fake.requests[-1]
        assert req.constraint.WhichOneof("kind") == kind and getattr(req.constraint, kind) == value
    assert main(["generate", "--url", url, "--choice", "red", "--choice", "blue", "hi"]) == 0
    assert list(fake.requests[-1].constraint.choice.choices) == ["red", "blue"]
    assert main(["generate", "--url", url, "hi"]) == 0 and not fake.requests[-1].HasField("constraint")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--url", url, "--regex", "a", "--choice", "b", "hi"])
    assert "not allowed with argument" in capsys.readouterr().err
    count = len(fake.requests)
    assert main(["generate", "--url", url, "--json-schema", str(tmp_path / "missing.json"), "hi"]) == 2
    assert "missing.json" in capsys.readouterr().err and len(fake.requests) == count


# --- beam search -----------------------------------------------------------------------------------------


# A beam's answer as the gateway sends it: the best hypothesis as the result, the n best in
# `sequences`; GenerateStream sends the same as its one chunk.
_BEAMS = [
    C.BeamSequence(text=" Paris.", token_ids=[21, 22, 2], score=-0.25, logprob=-0.75,
                   finish_reason=C.FINISH_REASON_EOS),
    C.BeamSequence(text=" Paris,", token_ids=[21, 23, 24], score=-0.5, logprob=-1.5,
                   finish_reason=C.FINISH_REASON_LENGTH),
    C.BeamSequence(text=" Lyon", token_ids=[25, 26], score=-1.25, logprob=-2.5, finish_reason=C.FINISH_REASON_STOP),
]
_BEAM_FINAL = dict(request_id="req-b", text=" Paris.", token_ids=[21, 22, 2], finish_reason=C.FINISH_REASON_EOS,
                   usage=C.Usage(prompt_tokens=4, completion_tokens=3), seed=5, sequences=_BEAMS,
                   stats=C.SpeculationStats(target_passes=4, beam_expansions=11),
                   timings=C.Timings(total_seconds=0.5))
_WANT_BEAMS = [
    BeamSequence(text=" Paris.", token_ids=[21, 22, 2], score=-0.25, logprob=-0.75, finish_reason="eos"),
    BeamSequence(text=" Paris,", token_ids=[21, 23, 24], score=-0.5, logprob=-1.5, finish_reason="length"),
    BeamSequence(text=" Lyon", token_ids=[25, 26], score=-1.25, logprob=-2.5, finish_reason="stop"),
]


@pytest.fixture
def beams(fake: FakeGeneration) -> FakeGeneration:
    fake.response = generation_pb2.GenerateResponse(**_BEAM_FINAL)
    fake.chunks = [generation_pb2.GenerateStreamResponse(**_BEAM_FINAL)]
    return fake


def _sent_beam(fake: FakeGeneration) -> tuple[Any, ...]:
    beam = fake.requests[-1].beam
    return (beam.num_beams, beam.num_return_sequences, beam.length_penalty, beam.early_stopping,
            beam.beam_threshold, beam.max_candidates_per_parent)


BEAM_OPTIONS = dict(num_beams=5, num_return_sequences=3, length_penalty=0.5, early_stopping="never",
                    beam_threshold=1.5, max_candidates_per_parent=2)
BEAM_WIRE = (5, 3, 0.5, C.EARLY_STOPPING_NEVER, 1.5, 2)


def test_beam_results_sync(client: Client, beams: FakeGeneration) -> None:
    res = client.generate("The capital of France is", **BEAM_OPTIONS)
    assert _sent_beam(beams) == BEAM_WIRE
    assert res.sequences == _WANT_BEAMS and res.text == " Paris." and res.finish_reason == "eos"
    assert res.stats.beam_expansions == 11
    with pytest.raises(AttributeError):
        res.sequences[0].score = 0.0  # type: ignore[misc]
    d = json.loads(json.dumps(res.to_dict()))
    assert d["sequences"][2] == {"text": " Lyon", "token_ids": [25, 26], "score": -1.25, "logprob": -2.5,
                                 "finish_reason": "stop"}
    (chunk,) = client.generate_stream("The capital of France is", num_beams=3)
    assert chunk.is_final and chunk.sequences == _WANT_BEAMS and chunk.text == res.text
    assert [s["finish_reason"] for s in chunk.to_dict()["sequences"]] == ["eos", "length", "stop"]
    assert beams.requests[-1].beam.num_beams == 3 and not beams.requests[-1].beam.HasField("beam_threshold")


def test_beam_results_async(url: str, beams: FakeGeneration) -> None:
    async def main() -> None:
        async with AsyncClient(url) as c:
            res = await c.generate("The capital of France is", **BEAM_OPTIONS)
            assert _sent_beam(beams) == BEAM_WIRE
            assert res.sequences == _WANT_BEAMS and res.stats.beam_expansions == 11
            chunks = [chunk async for chunk in c.generate_stream("x", num_beams=2, early_stopping=True)]
            assert len(chunks) == 1 and chunks[0].sequences == _WANT_BEAMS
            assert beams.requests[-1].beam.early_stopping == C.EARLY_STOPPING_FIRST_K
            res = await c.chat(MESSAGES, num_beams=4, num_return_sequences=2)
            assert res.sequences == _WANT_BEAMS and beams.requests[-1].WhichOneof("input") == "messages"
            assert (beams.requests[-1].beam.num_beams, beams.requests[-1].beam.num_return_sequences) == (4, 2)

    asyncio.run(main())


def test_results_without_beams_have_no_sequences(client: Client, fake: FakeGeneration) -> None:
    assert client.generate("hi").sequences == [] and "sequences" not in client.generate("hi").to_dict()
    assert not fake.requests[-1].HasField("beam")
    assert all(c.sequences == [] for c in client.generate_stream("hi"))


def test_cli_generate_beam_flags(url: str, beams: FakeGeneration, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    flags = ["--num-beams", "5", "--num-return", "3", "--length-penalty", "0.5", "--early-stopping", "never",
             "--beam-threshold", "1.5", "--max-candidates-per-parent", "2"]
    assert main(["generate", "--url", url, *flags, "The capital of France is"]) == 0
    assert _sent_beam(beams) == BEAM_WIRE
    out = capsys.readouterr()
    ranks = [line for line in out.out.splitlines() if line.startswith("#")]
    assert ranks == ["#1  score -0.2500  logprob -0.750  3 tokens  eos",
                     "#2  score -0.5000  logprob -1.500  3 tokens  length",
                     "#3  score -1.2500  logprob -2.500  2 tokens  stop"]
    assert out.out.splitlines()[1] == "     Paris." and "11 beam expansions" in out.err

    assert main(["generate", "--url", url, "--stream", "--num-beams", "2", "x"]) == 0
    streamed = capsys.readouterr().out
    assert streamed == out.out  # the one chunk is printed as the same n-best list

    assert main(["generate", "--url", url, "--json", "--num-beams", "2", "x"]) == 0
    assert [s["text"] for s in json.loads(capsys.readouterr().out)["sequences"]] == [" Paris.", " Paris,", " Lyon"]

    assert main(["generate", "--url", url, "--num-beams", "2", "--early-stopping", "first_k", "x"]) == 0
    beam = beams.requests[-1].beam  # what was not given is not sent: the server's defaults apply
    assert (beam.num_beams, beam.num_return_sequences, beam.early_stopping, beam.max_candidates_per_parent) == \
        (2, 0, C.EARLY_STOPPING_FIRST_K, 0)
    assert not beam.HasField("length_penalty") and not beam.HasField("beam_threshold")
    capsys.readouterr()

    sent = len(beams.requests)
    assert main(["generate", "--url", url, "--num-return", "2", "--beam-threshold", "1", "x"]) == 2
    assert "--num-return, --beam-threshold set beam search options and need --num-beams K" in capsys.readouterr().err
    assert len(beams.requests) == sent  # refused before any request
    for bad in (["--num-beams", "0"], ["--num-beams", "x"], ["--num-return", "0"], ["--early-stopping", "sometimes"],
                ["--max-candidates-per-parent", "-1"], ["--beam-threshold", "wide"]):
        with pytest.raises(SystemExit):
            main(["generate", "--url", url, "--num-beams", "2", *bad, "x"])
        assert bad[0] in capsys.readouterr().err


# --- chat ------------------------------------------------------------------------------------------------


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


def test_chat_sends_messages_with_the_generate_options(client: Client, fake: FakeGeneration) -> None:
    res = client.chat(MESSAGES, max_new_tokens=7, temperature=0.5, seed=3, speculation=2, stop=["\n"])
    req = fake.requests[-1]
    assert req.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "Be brief."), ("user", "Hi?")]
    assert (req.max_new_tokens, req.temperature, req.seed, req.speculation.gamma) == (7, 0.5, 3, 2)
    assert list(req.stop) == ["\n"] and res.text == "Hello world"
    chunks = list(client.chat_stream(MESSAGES, max_new_tokens=5))
    assert [c.text for c in chunks] == ["Hel", "lo", " world"]
    assert fake.requests[-1].WhichOneof("input") == "messages" and fake.requests[-1].max_new_tokens == 5
    with pytest.raises(TypeError, match="messages"):
        client.chat("Hi?")
    with pytest.raises(TypeError, match="unexpected keyword"):
        client.chat(MESSAGES, temprature=1.0)


def test_async_chat_and_chat_stream(url: str, fake: FakeGeneration) -> None:
    async def main() -> None:
        async with AsyncClient(url) as c:
            res = await c.chat(MESSAGES, max_new_tokens=4, top_k=5, temperature=1.0)
            assert res.finish_reason == "length"
            req = fake.requests[-1]
            assert req.WhichOneof("input") == "messages" and req.top_k == 5 and req.max_new_tokens == 4
            chunks = [chunk async for chunk in c.chat_stream(MESSAGES)]
            assert chunks[-1].finish_reason == "stop"
            assert len(fake.requests[-1].messages.messages) == 2

    asyncio.run(main())


def test_model_info_reports_a_chat_template(client: Client, fake: FakeGeneration) -> None:
    assert client.model_info().has_chat_template is False  # the canned info has none
    info = ModelInfo.from_pb(generation_pb2.ModelInfo(target_model="m", has_chat_template=True))
    assert info.has_chat_template is True


def test_cli_chat_builds_a_conversation(url: str, fake: FakeGeneration, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    assert main(["chat", "--url", url, "--system", "Be terse.", "--max-new-tokens", "9", "What is 2+2?"]) == 0
    req = fake.requests[-1]
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "Be terse."), ("user", "What is 2+2?")]
    assert req.max_new_tokens == 9
    assert capsys.readouterr().out.startswith("Hello world")
    assert main(["chat", "--url", url, "--stream", "Hi"]) == 0
    assert [(m.role, m.content) for m in fake.requests[-1].messages.messages] == [("user", "Hi")]


# --- Client and AsyncClient: one implementation, two kinds of I/O ----------------------------------------


def test_sync_and_async_take_the_same_arguments() -> None:
    assert inspect.signature(AsyncClient) == inspect.signature(Client)
    assert list(inspect.signature(Client).parameters) == ["url", "timeout", "options", "tls_ca", "tls_cert", "tls_key",
                                                         "server_name", "token"]
    for name in ("generate", "generate_stream", "chat", "chat_stream", "model_info"):
        sync, aio = getattr(Client, name), getattr(AsyncClient, name)
        assert inspect.signature(sync).parameters == inspect.signature(aio).parameters, name
        assert not inspect.iscoroutinefunction(sync)
        # The streams are made at once (arguments checked then) and iterated with `async for`.
        assert inspect.iscoroutinefunction(aio) is not name.endswith("_stream"), name


SAME_CALLS = [
    ("generate", ("Once upon",), dict(max_new_tokens=7, temperature=0.5, seed=3, stop=["\n"], logprobs=True,
                                      top_logprobs=2)),
    ("generate", ([5, 6, 7],), dict(options=GenerateOptions(num_beams=2, early_stopping="never"), request_id="b")),
    ("generate_stream", ("hi",), dict(speculation=2, top_k=4, top_p=0.5, stop_token_ids=[2])),
    ("chat", (MESSAGES,), dict(max_gamma=3, traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
    ("chat_stream", (MESSAGES,), dict(options=GenerateOptions(max_new_tokens=5), ignore_eos=True)),
    ("model_info", (), {}),
]
RPC_OF = {"generate": "Generate", "chat": "Generate", "generate_stream": "GenerateStream",
          "chat_stream": "GenerateStream", "model_info": "GetModelInfo"}


def run_sync(url: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``Client.<method>`` to its end: (the result, or the chunks a stream yielded; the SDK error raised
    or None)."""
    chunks: list[StreamChunk] = []
    with Client(url, timeout=30, token="s3cret") as c:
        try:
            if not method.endswith("_stream"):
                return getattr(c, method)(*args, **kwargs), None
            for chunk in getattr(c, method)(*args, **kwargs):
                chunks.append(chunk)
        except SpecstreamError as err:
            return chunks, err
    return chunks, None


def run_async(url: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``run_sync`` with an ``AsyncClient``."""
    chunks: list[StreamChunk] = []

    async def main() -> tuple[Any, Any]:
        async with AsyncClient(url, timeout=30, token="s3cret") as c:
            try:
                if not method.endswith("_stream"):
                    return await getattr(c, method)(*args, **kwargs), None
                async for chunk in getattr(c, method)(*args, **kwargs):
                    chunks.append(chunk)
            except SpecstreamError as err:
                return chunks, err
        return chunks, None

    return asyncio.run(main())


@pytest.mark.parametrize(("method", "args", "kwargs"), SAME_CALLS,
                         ids=[f"{call[0]}-{i}" for i, call in enumerate(SAME_CALLS)])
def test_sync_and_async_send_the_same_call_and_parse_the_same_result(
    url: str, fake: FakeGeneration, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    sync_result, sync_error = run_sync(url, method, args, kwargs)
    sync_requests, sync_calls = list(fake.requests), list(fake.calls)
    fake.reset()
    async_result, async_error = run_async(url, method, args, kwargs)
    assert sync_error is None and async_error is None
    assert len(sync_requests) == (0 if method == "model_info" else 1)
    assert fake.requests == sync_requests  # the same GenerateRequest, field for field
    # The same results: a GenerateResult or ModelInfo, or the same list of StreamChunks.
    assert type(async_result) is type(sync_result)
    assert async_result == sync_result
    if method.endswith("_stream"):
        assert [c.text for c in sync_result] == ["Hel", "lo", " world"] and sync_result[-1].is_final
    # The same call: the method, the client's token and its default deadline.
    for calls in (sync_calls, fake.calls):
        assert [(name, auth) for name, auth, _ in calls] == [(RPC_OF[method], "Bearer s3cret")]
        assert calls[0][2] == pytest.approx(30, abs=5)  # time_remaining() as the server reads it


FAILURES = [  # (method, its input, stream chunks sent before the failure)
    ("generate", ("hi",), 0),
    ("chat", (MESSAGES,), 0),
    ("generate_stream", ("hi",), 0),
    ("chat_stream", (MESSAGES,), 2),
    ("model_info", (), 0),
]


@pytest.mark.parametrize(("code", "cls"), ERROR_CASES)
def test_sync_and_async_raise_the_same_errors(url: str, fake: FakeGeneration, code: grpc.StatusCode,
                                              cls: type[SpecstreamError]) -> None:
    for method, args, abort_after in FAILURES:
        outcomes = []
        for run in (run_sync, run_async):
            fake.reset()
            fake.abort, fake.abort_after = (code, f"{method} failed"), abort_after
            got, err = run(url, method, args, {})
            assert isinstance(err, SpecstreamError), (method, run.__name__)
            assert isinstance(err.__cause__, grpc.RpcError)
            outcomes.append((type(err), err.code, err.details, [chunk.text for chunk in got]))
        assert outcomes[0] == outcomes[1], method
        assert outcomes[0] == (cls, code, f"{method} failed", ["Hel", "lo"][:abort_after]), method


def test_the_default_deadline_is_read_at_each_call(url: str, fake: FakeGeneration) -> None:
    # `timeout` is a public attribute of both clients; a call without a deadline of its own reads it.
    fake.delay = 30.0
    with Client(url) as c:
        c.timeout = 0.2
        with pytest.raises(DeadlineExceeded):
            c.generate("hi")

    async def main() -> None:
        async with AsyncClient(url) as c:
            c.timeout = 0.2
            with pytest.raises(DeadlineExceeded):
                await c.chat(MESSAGES)
            c.timeout = -1
            with pytest.raises(ValueError, match="timeout must be > 0 seconds, got -1"):
                await c.model_info()

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 10


def test_cancelling_the_awaiting_task_cancels_the_rpc(url: str, fake: FakeGeneration) -> None:
    # asyncio.CancelledError passes through the SDK's error mapping unchanged (it is not an RpcError).
    fake.delay = 5.0

    async def main() -> None:
        async with AsyncClient(url) as c:
            task = asyncio.create_task(c.generate("hi"))
            while not fake.calls:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(fake.finished.wait, 1.5)

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


def test_cli_n_samples_are_sent_and_printed_each_under_its_number(url: str, fake: FakeGeneration,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import main

    response = generation_pb2.GenerateResponse()
    response.CopyFrom(fake.response)
    for i, text in enumerate(["first answer", "second\nanswer"]):
        response.samples.add(index=i, text=text, seed=5 + i)
    fake.response = response
    assert main(["generate", "--url", url, "--n", "2", "--temperature", "0.8", "--seed", "5", "hi"]) == 0
    assert fake.requests[-1].n == 2
    out = capsys.readouterr().out
    assert "#0  seed 5\n    first answer\n#1  seed 6\n    second\n    answer\n" in out
    assert main(["generate", "--url", url, "hi"]) == 0 and not fake.requests[-1].n  # one: n not sent
    with pytest.raises(SystemExit):
        main(["generate", "--url", url, "--n", "0", "hi"])
    assert "--n" in capsys.readouterr().err
