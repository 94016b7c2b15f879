"""The SDK's generation options are defined once (``GenerateOptions``): every generate/chat entry
point takes exactly that set, every option reaches the wire, and the keyword form, the object form
and the two mixed send the same request. Against an in-process recording Generation service."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import typing
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from tests.support.fake_gateway import serve_generation

from specstream_client import AsyncClient, Client, GenerateOptions, GenerateOptionsDict
from specstream_client._request import build_chat_request, build_generate_request
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc

MESSAGES = [{"role": "user", "content": "Hi?"}]

# A value other than the default for every option. Adding an option means adding it here too
# (test_sample_covers_every_option says so), which proves it reaches the wire.
SAMPLE: dict[str, Any] = {
    "max_new_tokens": 9,
    "speculation": 3,
    "max_gamma": 5,
    "stop": ["\n", "END"],
    "stop_token_ids": [2, 7],
    "ignore_eos": True,
    "temperature": 0.5,
    "top_k": 40,
    "top_p": 0.9,
    "seed": 12345,
    "logprobs": True,
    "top_logprobs": 2,
    "request_id": "req-sample",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "num_beams": 4,
    "num_return_sequences": 2,
    "length_penalty": 0.5,
    "early_stopping": "never",
    "beam_threshold": 1.5,
    "max_candidates_per_parent": 3,
    "min_tokens": 4,
    "json_schema": {"type": "object"},
    "json_object": True,
    "regex": "[a-z]+",
    "choice": ["a", "b"],
    "grammar": 'start: "x"',
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.25,
    "logit_bias": {7: 2.5, "9": -100.0},
    "tools": [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
              {"type": "function", "function": {"name": "noop", "description": "does nothing"}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "cache_salt": "tenant-7",
    "n": 3,
}
# Every option set at once: max_gamma goes with automatic speculation only, so twice; the five
# constraints exclude each other, so regex stands for them.
_ONE_CONSTRAINT = {k: v for k, v in SAMPLE.items() if k not in ("json_schema", "json_object", "choice", "grammar")}
COMBINED = [{**_ONE_CONSTRAINT, "speculation": "auto"}, {k: v for k, v in _ONE_CONSTRAINT.items() if k != "max_gamma"}]

# (name, the input it takes) of every public entry point that sends a GenerateRequest.
ENTRY_POINTS = [
    (Client.generate, "prompt"),
    (Client.generate_stream, "prompt"),
    (Client.chat, "messages"),
    (Client.chat_stream, "messages"),
    (AsyncClient.generate, "prompt"),
    (AsyncClient.generate_stream, "prompt"),
    (AsyncClient.chat, "messages"),
    (AsyncClient.chat_stream, "messages"),
]
BUILDERS = [(build_generate_request, "prompt"), (build_chat_request, "messages")]


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GenerateOptions)]


def without_input(req: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    out = generation_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.ClearField("input")
    return out


class Recorder(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(request)
        return generation_pb2.GenerateResponse(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH)

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.requests.append(request)
        yield generation_pb2.GenerateStreamResponse(request_id=request.request_id,
                                                    finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Recorder, str]]:
    recorder = Recorder()
    with serve_generation(recorder, workers=4) as address:
        yield recorder, address


def send(url: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call a Client or AsyncClient entry point to completion (streams drained)."""
    owner = Client if method.__qualname__.startswith("Client.") else AsyncClient
    if owner is Client:
        with Client(url) as client:
            out = getattr(client, method.__name__)(*args, **kwargs)
            if method.__name__.endswith("_stream"):
                list(out)
        return

    async def main() -> None:
        async with AsyncClient(url) as client:
            out = getattr(client, method.__name__)(*args, **kwargs)
            if method.__name__.endswith("_stream"):
                [chunk async for chunk in out]
            else:
                await out

    asyncio.run(main())


# --- one definition ---------------------------------------------------------------------------------


def test_typed_dict_mirrors_the_dataclass() -> None:
    # Python cannot derive the keyword TypedDict from the dataclass, so the mirror is checked here:
    # same names, same order, same type annotations, every key optional.
    fields = typing.get_type_hints(GenerateOptions)
    keywords = typing.get_type_hints(GenerateOptionsDict)
    assert list(keywords.items()) == list(fields.items())
    assert GenerateOptionsDict.__total__ is False and not GenerateOptionsDict.__required_keys__


@pytest.mark.parametrize(("method", "input_name"), ENTRY_POINTS + BUILDERS,
                         ids=lambda p: getattr(p, "__qualname__", p))
def test_entry_points_take_the_options_and_nothing_else(method: Callable[..., Any], input_name: str) -> None:
    # Fails if an option is spelled out as a parameter of one entry point instead of in
    # GenerateOptions: the only parameters are the input, the options object, the call's
    # deadline (not a request field) and the GenerateOptionsDict keywords.
    params = list(inspect.signature(method).parameters.values())
    if params[0].name == "self":
        params = params[1:]
        expected = [input_name, "options", "timeout", "overrides"]
    else:
        expected = [input_name, "options", "overrides"]  # the builders have no deadline
    assert [p.name for p in params] == expected
    by_name = {p.name: p for p in params}
    assert by_name["options"].annotation == "GenerateOptions | None" and by_name["options"].default is None
    assert by_name["overrides"].kind is inspect.Parameter.VAR_KEYWORD
    assert by_name["overrides"].annotation == "Unpack[GenerateOptionsDict]"
    assert not set(expected) & set(option_names())  # no option shadowed by a parameter


def test_sample_covers_every_option() -> None:
    assert list(SAMPLE) == option_names()


def test_defaults_are_the_dataclass_defaults() -> None:
    assert build_generate_request("x") == build_generate_request("x", GenerateOptions())
    req = without_input(build_generate_request("x"))
    assert req == GenerateOptions().to_pb()
    assert req.max_new_tokens == 64 and req.speculation.mode == common_pb2.SPECULATION_MODE_AUTO
    assert not req.HasField("top_p") and not req.HasField("seed")


@pytest.mark.parametrize("name", list(SAMPLE))
def test_every_option_reaches_the_wire(name: str) -> None:
    # A field added to GenerateOptions but not to to_pb() sends the default request.
    value = SAMPLE[name]
    assert GenerateOptions(**{name: value}).to_pb() != GenerateOptions().to_pb(), name
    assert build_generate_request("x", **{name: value}) != build_generate_request("x"), name
    assert build_chat_request(MESSAGES, **{name: value}) != build_chat_request(MESSAGES), name


@pytest.mark.parametrize("combined", [0, 1])
@pytest.mark.parametrize(("method", "input_name"), ENTRY_POINTS, ids=lambda p: getattr(p, "__qualname__", p))
def test_every_entry_point_sends_every_option(served: tuple[Recorder, str], method: Callable[..., Any],
                                              input_name: str, combined: int) -> None:
    recorder, url = served
    given = "hello" if input_name == "prompt" else MESSAGES
    options = COMBINED[combined]
    expected = GenerateOptions(**options).to_pb()

    recorder.requests.clear()
    send(url, method, given, **options)  # keywords
    send(url, method, given, GenerateOptions(**options))  # one object
    base = GenerateOptions(max_new_tokens=1, seed=1, stop="x", top_k=3)
    send(url, method, given, base, **options)  # keywords override the object's fields
    assert len(recorder.requests) == 3
    for req in recorder.requests:
        assert without_input(req) == expected
        assert req.WhichOneof("input") == ("prompt" if input_name == "prompt" else "messages")
    # The values the sample puts on the wire, spelled out once.
    req = recorder.requests[0]
    if combined == 0:
        assert (req.speculation.mode, req.speculation.gamma, req.speculation.max_gamma) == \
            (common_pb2.SPECULATION_MODE_AUTO, 0, 5)
    else:
        assert (req.speculation.mode, req.speculation.gamma, req.speculation.max_gamma) == \
            (common_pb2.SPECULATION_MODE_FIXED, 3, 0)
    assert req.max_new_tokens == 9
    assert list(req.stop) == ["\n", "END"] and list(req.stop_token_ids) == [2, 7] and req.ignore_eos
    assert (req.temperature, req.top_k, req.top_p, req.seed) == (0.5, 40, pytest.approx(0.9), 12345)
    assert req.min_tokens == 4
    assert req.constraint.WhichOneof("kind") == "regex" and req.constraint.regex == "[a-z]+"
    assert req.logprobs and req.top_logprobs == 2
    assert req.request_id == "req-sample" and req.traceparent == SAMPLE["traceparent"]
    assert [(t.name, t.description, t.parameters) for t in req.tools] == [
        ("get_weather", "", '{"type": "object", "properties": {"city": {"type": "string"}}}'),
        ("noop", "does nothing", "")]
    assert req.tool_choice == "required" and req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    assert req.cache_salt == "tenant-7" and req.n == 3


def test_earlier_tool_calls_go_back_in_either_form() -> None:
    from specstream_client import ToolCall

    made = ToolCall("call_1", "get_weather", '{"city":"Paris"}')
    for call in (made, {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}):
        req = build_chat_request([{"role": "user", "content": "weather?"},
                                  {"role": "assistant", "content": None, "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "21C"}])
        assistant, tool = req.messages.messages[1], req.messages.messages[2]
        assert assistant.content == "" and [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
            ("call_1", "get_weather", {"city": "Paris"})]
        assert tool.tool_call_id == "call_1" and tool.content == "21C"
    with pytest.raises(TypeError, match=r"messages\[0\].tool_calls\[0\]\['name'\]"):
        build_chat_request([{"role": "assistant", "content": "", "tool_calls": [{"arguments": "{}"}]}])
    with pytest.raises(ValueError, match=r"tools\[0\] has unsupported keys \['parms'\]"):
        GenerateOptions(tools=[{"name": "f", "parms": {}}])


# --- the options object ----------------------------------------------------------------------------------


def test_object_plus_keywords() -> None:
    base = GenerateOptions(max_new_tokens=5, temperature=0.7, stop="\n")
    req = build_generate_request("x", base, seed=3, max_new_tokens=6)
    assert (req.max_new_tokens, req.temperature, req.seed) == (6, pytest.approx(0.7), 3)
    assert list(req.stop) == ["\n"]
    assert base.max_new_tokens == 5 and base.seed is None  # the object is not changed


def test_options_are_frozen_and_own_their_sequences() -> None:
    stop = ["a"]
    ids = [1, 2]
    opts = GenerateOptions(stop=stop, stop_token_ids=ids)
    stop.append("b")
    ids.append(3)
    assert opts.stop == ("a",) and opts.stop_token_ids == (1, 2)
    assert GenerateOptions(stop="a").stop == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1  # type: ignore[misc]
    assert opts == GenerateOptions(stop=("a",), stop_token_ids=(1, 2))
    assert hash(opts) == hash(GenerateOptions(stop=("a",), stop_token_ids=(1, 2)))


def test_numpy_style_ints_are_stored_as_ints() -> None:
    class Index:
        def __index__(self) -> int:
            return 7

    opts = GenerateOptions(max_new_tokens=Index(), seed=Index(), top_k=Index())  # type: ignore[arg-type]
    assert (opts.max_new_tokens, opts.seed, opts.top_k) == (7, 7, 7)
    assert type(opts.seed) is int


@pytest.mark.parametrize(("kwargs", "exc", "needle"), [
    (dict(seed=-1), ValueError, "seed"),
    (dict(top_k=2**31), ValueError, "top_k"),
    (dict(max_new_tokens="8"), TypeError, "max_new_tokens"),
    (dict(stop=[1]), TypeError, r"stop\[0\]"),
    (dict(stop=b"x"), TypeError, "stop"),
    (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids\[0\]"),
    (dict(speculation=True), ValueError, "speculation"),
    (dict(request_id=7), TypeError, "request_id"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
])
def test_bad_values_raise_when_the_options_are_made(kwargs: dict[str, Any], exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        GenerateOptions(**kwargs)
    with pytest.raises(exc, match=needle):  # replace() checks again
        dataclasses.replace(GenerateOptions(), **kwargs)
    with pytest.raises(exc, match=needle):
        build_generate_request("x", GenerateOptions(), **kwargs)


def test_unknown_option_and_wrong_options_type() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'.*did you mean 'temperature'"):
        build_generate_request("x", temprature=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        build_chat_request(MESSAGES, timeout=3)  # a call argument, not a request option
    with pytest.raises(TypeError, match="options must be a GenerateOptions"):
        build_generate_request("x", {"max_new_tokens": 3})  # type: ignore[arg-type]


def test_client_rejects_before_sending(served: tuple[Recorder, str]) -> None:
    recorder, url = served
    recorder.requests.clear()
    with Client(url) as client:
        with pytest.raises(TypeError, match="options must be a GenerateOptions"):
            client.generate("x", 8)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seed"):
            client.chat_stream(MESSAGES, GenerateOptions(), seed=-1)
        with pytest.raises(TypeError, match="did you mean 'max_new_tokens'"):
            client.generate("x", max_tokens=8)  # type: ignore[call-arg]
    assert recorder.requests == []


# --- max_gamma -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 8, 1000, 2**32 - 1])  # above the server's max: the server judges it
def test_max_gamma_caps_automatic_speculation_on_the_wire(cap: int) -> None:
    for req in (build_generate_request("x", max_gamma=cap), build_chat_request(MESSAGES, max_gamma=cap),
                build_generate_request("x", speculation="auto", max_gamma=cap)):
        assert req.speculation.mode == common_pb2.SPECULATION_MODE_AUTO
        assert req.speculation.max_gamma == cap and req.speculation.gamma == 0


def test_max_gamma_unset_sends_zero_the_servers_limit() -> None:
    for speculation in ("auto", "off", 0, 4):
        assert build_generate_request("x", speculation=speculation).speculation.max_gamma == 0
    assert build_generate_request("x", max_gamma=None).speculation.max_gamma == 0


def test_max_gamma_reaches_the_server(served: tuple[Recorder, str]) -> None:
    recorder, url = served
    recorder.requests.clear()
    with Client(url) as client:
        client.generate("x", max_gamma=3)
        list(client.chat_stream(MESSAGES, GenerateOptions(max_gamma=6), max_new_tokens=2))

    async def main() -> None:
        async with AsyncClient(url) as client:
            await client.chat(MESSAGES, max_gamma=4)
            [chunk async for chunk in client.generate_stream("x", GenerateOptions(max_gamma=1), max_gamma=7)]

    asyncio.run(main())
    assert [r.speculation.max_gamma for r in recorder.requests] == [3, 6, 4, 7]
    assert {r.speculation.mode for r in recorder.requests} == {common_pb2.SPECULATION_MODE_AUTO}


@pytest.mark.parametrize(("value", "exc", "needle"), [
    (0, ValueError, "max_gamma must be >= 1, got 0"),  # the wire's 0 would mean "the server's limit"
    (-1, ValueError, "max_gamma must fit in uint32.*got -1"),
    (2**32, ValueError, f"max_gamma must fit in uint32.*got {2**32}"),
    (True, TypeError, "max_gamma must be an int, got True"),
    (2.0, TypeError, "max_gamma must be an int, got 2.0"),
    ("4", TypeError, "max_gamma must be an int, got '4'"),
])
def test_bad_max_gamma_raises_before_sending(served: tuple[Recorder, str], value: Any, exc: type,
                                             needle: str) -> None:
    with pytest.raises(exc, match=needle):
        GenerateOptions(max_gamma=value)
    with pytest.raises(exc, match=needle):
        build_generate_request("x", max_gamma=value)
    recorder, url = served
    recorder.requests.clear()
    with Client(url) as client:
        with pytest.raises(exc, match=needle):
            client.generate("x", max_gamma=value)
        with pytest.raises(exc, match=needle):
            client.chat_stream(MESSAGES, max_gamma=value)
    assert recorder.requests == []


@pytest.mark.parametrize("speculation", ["off", 0, 1, 4])
def test_max_gamma_needs_automatic_speculation(speculation: str | int) -> None:
    # A fixed gamma already says how many tokens to draft, and "off" drafts none: a cap on the
    # automatic controller would be ignored, so it is refused here, naming both options.
    pattern = rf"max_gamma=5 .*speculation='auto', got speculation={speculation!r}"
    with pytest.raises(ValueError, match=pattern):
        GenerateOptions(speculation=speculation, max_gamma=5)
    with pytest.raises(ValueError, match=pattern):
        build_chat_request(MESSAGES, GenerateOptions(max_gamma=5), speculation=speculation)
    with pytest.raises(ValueError, match=pattern):
        build_generate_request("x", GenerateOptions(speculation=speculation), max_gamma=5)
    # Replacing the cap with None (the server's limit) makes the pair valid again.
    opts = GenerateOptions(max_gamma=5)
    assert dataclasses.replace(opts, speculation=speculation, max_gamma=None).max_gamma is None


# --- beam search ----------------------------------------------------------------------------------------


def test_beam_options_reach_the_wire_as_one_message() -> None:
    assert not GenerateOptions().to_pb().HasField("beam")  # no beam option: one sequence
    beam = GenerateOptions(num_beams=5, num_return_sequences=3, early_stopping=True).to_pb().beam
    assert (beam.num_beams, beam.num_return_sequences, beam.early_stopping) == (5, 3, common_pb2.EARLY_STOPPING_FIRST_K)
    assert not beam.HasField("length_penalty") and not beam.HasField("beam_threshold")  # unset: server defaults
    assert GenerateOptions(num_beams=2, length_penalty=0.0).to_pb().beam.HasField("length_penalty")
    assert GenerateOptions(num_beams=2, early_stopping=False).to_pb().beam.early_stopping == \
        common_pb2.EARLY_STOPPING_HEURISTIC
    # a beam option without num_beams is sent, num_beams 0: the server names it
    assert GenerateOptions(beam_threshold=1.0).to_pb().beam.num_beams == 0


@pytest.mark.parametrize("value", ["sometimes", 1, None.__class__])
def test_bad_early_stopping_raises_when_made(value: Any) -> None:
    with pytest.raises(ValueError, match="early_stopping"):
        GenerateOptions(num_beams=2, early_stopping=value)


@pytest.mark.parametrize(("value", "wire"), [
    (False, common_pb2.EARLY_STOPPING_HEURISTIC),
    ("heuristic", common_pb2.EARLY_STOPPING_HEURISTIC),
    (True, common_pb2.EARLY_STOPPING_FIRST_K),
    ("first_k", common_pb2.EARLY_STOPPING_FIRST_K),
    ("never", common_pb2.EARLY_STOPPING_NEVER),
    (None, common_pb2.EARLY_STOPPING_UNSPECIFIED),  # not sent: the server's default (heuristic)
])
def test_each_early_stopping_spelling_reaches_the_wire(value: Any, wire: int) -> None:
    assert GenerateOptions(num_beams=2, early_stopping=value).to_pb().beam.early_stopping == wire


@pytest.mark.parametrize(("name", "value", "error"), [
    ("num_beams", "4", TypeError),
    ("num_beams", True, TypeError),
    ("num_beams", 2**31, ValueError),  # outside int32
    ("num_return_sequences", 1.5, TypeError),
    ("max_candidates_per_parent", -(2**31) - 1, ValueError),
    ("length_penalty", "1", TypeError),
    ("beam_threshold", True, TypeError),
])
def test_unencodable_beam_options_raise_when_made(name: str, value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=name):
        GenerateOptions(num_beams=2, **{name: value}) if name != "num_beams" else GenerateOptions(num_beams=value)


def test_beam_ranges_are_the_servers_to_judge() -> None:
    # Encodable but out of range: sent as given, so the server's INVALID_ARGUMENT names the field.
    beam = GenerateOptions(num_beams=-1, num_return_sequences=9, length_penalty=float("nan"),
                           beam_threshold=0.0, max_candidates_per_parent=-3).to_pb().beam
    assert (beam.num_beams, beam.num_return_sequences, beam.beam_threshold, beam.max_candidates_per_parent) == \
        (-1, 9, 0.0, -3)
    assert beam.HasField("length_penalty") and beam.length_penalty != beam.length_penalty  # NaN
