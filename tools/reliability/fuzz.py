"""A seeded fuzzer of the public API: gRPC `Generation` and, when given, the OpenAI-compatible HTTP
front. Every case carries its oracle, so "a wrong code" is checked, not only "no crash":

- **grpc-invalid**: a valid request with one field made invalid (a catalogue of every rule in
  gateway/validation.py and the beam options, values drawn at random) -> INVALID_ARGUMENT whose
  message starts with that field's name.
- **grpc-valid**: a request with random valid values in many fields -> served.
- **grpc-bytes**: random bytes, and valid requests truncated, bit-flipped or with an unknown field
  -> served or INVALID_ARGUMENT (bytes that happen to parse are validated like any request),
  never another code.
- **grpc-constraint**: a valid request with a random constraint (tools/reliability/fuzz_constraints.py:
  JSON schemas of random shapes, regexes, Lark grammars, choices; about a third broken on
  purpose) -> served, or INVALID_ARGUMENT naming `constraint.<kind>`.
- **grpc-tools**: a chat with random tools (the http-tools body's, in the request's own fields),
  tool_choice, parallel_tool_calls and sometimes an assistant's earlier call -> served or
  INVALID_ARGUMENT.
- **http-invalid** / **http-valid** / **http-bytes**: the same for `/v1/completions` and
  `/v1/chat/completions` (400 naming `param`, 404 for another model, 200; undecodable bodies 400).
- **http-tools**: a chat with random tools, tool_choice and parallel_tool_calls -> 200 or 400.

A crash is a process gone (connection refused, UNAVAILABLE), UNKNOWN or INTERNAL from gRPC, a 5xx
from HTTP, or a stack that no longer serves afterwards. Served requests are short: run the gateway
with a small `--max-new-tokens-limit` so random bytes that parse cannot ask for long generations.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc

from gateway.samples import MAX_SAMPLES
from specstream.data.prefix import MAX_SALT_CHARS
from tools.progress import Progress
from tools.reliability.fuzz_constraints import random_constraint, random_tools_body
from specstream_pb import common_pb2, generation_pb2

OK = "OK"
INVALID = grpc.StatusCode.INVALID_ARGUMENT.name
GRPC_KINDS = ("grpc-invalid", "grpc-valid", "grpc-bytes", "grpc-constraint", "grpc-tools")
KINDS = (*GRPC_KINDS, "http-invalid", "http-valid", "http-bytes", "http-tools")


@dataclass(frozen=True)
class Limits:
    """What the fuzzer needs to know of the served model (from GetModelInfo)."""

    vocab_size: int
    max_new_tokens: int
    max_gamma: int
    max_context: int
    chat: bool
    model: str
    max_top_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_chars: int = 128
    max_request_id_chars: int = 128
    max_messages: int = 256


@dataclass
class Case:
    kind: str
    payload: bytes  # the serialized request or the HTTP body
    expected: frozenset[str]  # outcomes that are right: "OK", a gRPC code name, or an HTTP status "400"
    field: str | None = None  # an invalid case: the field (gRPC) or param (HTTP) the error must name
    path: str = "/v1/completions"  # HTTP cases
    stream: bool = False  # gRPC: GenerateStream instead of Generate


@dataclass
class Outcome:
    case: Case
    got: str  # "OK", a gRPC code name, or an HTTP status
    named: str | None  # the field/param the error named (as far as it can be read)
    seconds: float

    @property
    def crash(self) -> bool:
        return self.got in ("UNAVAILABLE", "UNKNOWN", "INTERNAL", "CONNECTION") or self.got.startswith("5")

    @property
    def wrong(self) -> bool:
        if self.got not in self.case.expected:
            return True
        return self.case.field is not None and self.got != OK and self.named != self.case.field


@dataclass
class Report:
    seed: int
    cases: int
    by_kind: dict[str, int]
    outcomes: dict[str, int]  # "kind got" -> count
    crashes: int
    wrong: int
    examples: list[dict] = field(default_factory=list)  # the first crashes / wrong codes
    seconds: float = 0.0
    serving_after: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


# --- cases ---------------------------------------------------------------------------------------

def _text(rng: random.Random, low: int = 1, high: int = 24) -> str:
    alphabet = string.ascii_letters + string.digits + " .,\n\t" + "éüß漢字🙂\u200b"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def _valid(rng: random.Random, lim: Limits) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=rng.randint(1, min(2, lim.max_new_tokens)))
    form = rng.choice(["prompt", "ids", "messages"] if lim.chat else ["prompt", "ids"])
    if form == "prompt":
        req.prompt = _text(rng) or "x"
    elif form == "ids":
        req.prompt_token_ids.ids.extend(rng.randrange(lim.vocab_size) for _ in range(rng.randint(1, 16)))
    else:
        for _ in range(rng.randint(1, 3)):
            req.messages.messages.add(role=rng.choice(["system", "user", "assistant", "user"]), content=_text(rng, 0))
    if rng.random() < 0.5:
        req.temperature = rng.choice([0.0, rng.uniform(0.01, 2.0)])
        req.top_k = rng.choice([0, rng.randint(1, 50)])
        if rng.random() < 0.5:
            req.top_p = rng.uniform(0.05, 1.0)
    if rng.random() < 0.3:
        req.seed = rng.getrandbits(64)
    if rng.random() < 0.3:
        req.stop.extend(_text(rng, 1, 8) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.2:
        req.stop_token_ids.extend(rng.randrange(lim.vocab_size) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.3:
        req.logprobs = True
        req.top_logprobs = rng.randint(0, min(5, lim.max_top_logprobs))
    mode = rng.choice(["auto", "off", "fixed", "unset"])
    if mode == "auto":
        req.speculation.mode = common_pb2.SPECULATION_MODE_AUTO
        req.speculation.max_gamma = rng.randint(0, lim.max_gamma)
    elif mode == "off":
        req.speculation.mode = common_pb2.SPECULATION_MODE_OFF
    elif mode == "fixed" and lim.max_gamma >= 1:
        req.speculation.mode = common_pb2.SPECULATION_MODE_FIXED
        req.speculation.gamma = rng.randint(1, lim.max_gamma)
    if rng.random() < 0.3:
        req.request_id = _text(rng, 1, 32)
    req.ignore_eos = rng.random() < 0.3
    if rng.random() < 0.3:
        req.min_tokens = rng.randint(0, req.max_new_tokens)
    if rng.random() < 0.2:
        req.cache_salt = _text(rng, 0, MAX_SALT_CHARS)
    if rng.random() < 0.2:
        req.penalties.CopyFrom(common_pb2.Penalties(
            presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.choice([0.0, rng.uniform(0.05, 2.0)]),
            logit_bias={rng.randrange(lim.vocab_size): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))}))
    return req


def _bad_float(rng: random.Random, low_ok: float, high_ok: float | None) -> float:
    options = [math.nan, math.inf, -math.inf, low_ok - rng.uniform(0.001, 1e6)]
    if high_ok is not None:
        options.append(high_ok + rng.uniform(0.01, 1e6))
    return rng.choice(options)


def _invalid_mutations(lim: Limits) -> list[tuple[str, Callable[[generation_pb2.GenerateRequest, random.Random], None]]]:
    """(the field the error must name, how to break it), one per validation rule."""

    def speculation(mode: int, gamma: int = 0, max_gamma: int = 0):
        def apply(r, rng):
            r.speculation.CopyFrom(common_pb2.Speculation(mode=mode, gamma=gamma, max_gamma=max_gamma))
        return apply

    def set_(name: str, value: Callable[[random.Random], object]):
        return lambda r, rng: setattr(r, name, value(rng))

    def prompt_ids(make: Callable[[random.Random], list[int]]):
        def apply(r, rng):
            r.prompt_token_ids.ids[:] = []
            r.prompt_token_ids.SetInParent()
            r.prompt_token_ids.ids.extend(make(rng))
        return apply

    def messages(make: Callable[[random.Random], list[tuple[str, str]]]):
        def apply(r, rng):
            r.messages.SetInParent()
            del r.messages.messages[:]
            for role, content in make(rng):
                r.messages.messages.add(role=role, content=content)
        return apply

    def beam(**values):
        def apply(r, rng):
            r.speculation.Clear()
            r.temperature, r.top_k, r.logprobs, r.top_logprobs = 0.0, 0, False, 0
            r.ClearField("top_p")
            r.min_tokens = 0
            del r.stop[:]
            r.beam.CopyFrom(common_pb2.BeamSearch(num_beams=2, **values))
        return apply

    def stop_ids(r, rng):
        r.stop_token_ids.append(rng.randint(lim.vocab_size, 2**32 - 1))

    def set_constraint(kind: str, value: Callable[[random.Random], str]):
        def apply(r, rng):
            r.min_tokens = 0  # a constraint refuses min_tokens beside it: the constraint is what is broken
            setattr(r.constraint, kind, value(rng))
        return apply

    cases = [
        ("max_new_tokens", set_("max_new_tokens", lambda rng: rng.choice([0, rng.randint(-2**31, -1)]))),
        ("max_new_tokens", set_("max_new_tokens", lambda rng: rng.randint(lim.max_new_tokens + 1, 2**31 - 1))),
        ("temperature", set_("temperature", lambda rng: _bad_float(rng, 0.0, None))),
        ("top_k", set_("top_k", lambda rng: rng.randint(-2**31, -1))),
        ("top_p", set_("top_p", lambda rng: rng.choice([0.0, _bad_float(rng, 0.0, 1.0)]))),
        ("top_logprobs", lambda r, rng: (setattr(r, "logprobs", True),
                                         setattr(r, "top_logprobs", rng.randint(lim.max_top_logprobs + 1, 2**31 - 1)))),
        ("top_logprobs", lambda r, rng: (setattr(r, "logprobs", False), setattr(r, "top_logprobs", rng.randint(1, 5)))),
        ("stop", lambda r, rng: r.stop.extend(["s"] * (lim.max_stop_strings + 1 - len(r.stop)))),
        ("stop[0]", lambda r, rng: (r.ClearField("stop"), r.stop.append(""))),
        ("stop[0]", lambda r, rng: (r.ClearField("stop"), r.stop.append("x" * (lim.max_stop_chars + 1)))),
        ("stop_token_ids[0]", lambda r, rng: (r.ClearField("stop_token_ids"), stop_ids(r, rng))),
        ("min_tokens", lambda r, rng: setattr(r, "min_tokens", r.max_new_tokens + rng.randint(1, 2**20))),
        ("request_id", set_("request_id", lambda rng: "r" * rng.randint(lim.max_request_id_chars + 1, 4096))),
        ("traceparent", set_("traceparent", lambda rng: _text(rng, 1, 60))),
        ("prompt", lambda r, rng: setattr(r, "prompt", "")),
        ("prompt_token_ids", prompt_ids(lambda rng: [])),
        ("prompt_token_ids", prompt_ids(lambda rng: [rng.randint(lim.vocab_size, 2**32 - 1)])),
        ("prompt_token_ids", prompt_ids(lambda rng: [1] * lim.max_context)),
        ("speculation.mode", lambda r, rng: r.speculation.CopyFrom(common_pb2.Speculation(mode=rng.randint(4, 1000)))),
        ("speculation.gamma", speculation(common_pb2.SPECULATION_MODE_FIXED, gamma=lim.max_gamma + 1)),
        ("speculation.gamma", speculation(common_pb2.SPECULATION_MODE_OFF, gamma=1)),
        ("speculation.max_gamma", speculation(common_pb2.SPECULATION_MODE_AUTO, max_gamma=lim.max_gamma + 1)),
        ("speculation.max_gamma", speculation(common_pb2.SPECULATION_MODE_OFF, max_gamma=1)),
        ("beam.num_beams", lambda r, rng: (beam()(r, rng), setattr(r.beam, "num_beams", rng.randint(-2**31, 0)))),
        ("beam.num_return_sequences", beam(num_return_sequences=3)),
        ("beam.early_stopping", beam(early_stopping=99)),
        ("temperature", lambda r, rng: (beam()(r, rng), setattr(r, "temperature", 0.5))),
        ("constraint.json_schema", set_constraint("json_schema", lambda rng: rng.choice(["{", "[1]", '{"type": "strin"}']))),
        ("constraint.regex", set_constraint("regex", lambda rng: rng.choice(["(", "[z-a]", "a{5,2}"]))),
        ("constraint.grammar", set_constraint("grammar", lambda rng: rng.choice(["start: nowhere", "start: (", "x"]))),
        ("constraint.choice", lambda r, rng: (setattr(r, "min_tokens", 0), r.constraint.choice.SetInParent())),
        ("penalties.presence_penalty", lambda r, rng: r.penalties.CopyFrom(common_pb2.Penalties(
            presence_penalty=rng.choice([_bad_float(rng, -2.0, 2.0), rng.uniform(2.01, 100)])))),
        ("penalties.frequency_penalty", lambda r, rng: r.penalties.CopyFrom(common_pb2.Penalties(
            frequency_penalty=_bad_float(rng, -2.0, 2.0)))),
        ("penalties.repetition_penalty", lambda r, rng: r.penalties.CopyFrom(common_pb2.Penalties(
            repetition_penalty=rng.choice([-rng.uniform(0.01, 5), rng.uniform(2.01, 100)])))),
        (f"penalties.logit_bias[{lim.vocab_size}]", lambda r, rng: r.penalties.CopyFrom(common_pb2.Penalties(
            logit_bias={lim.vocab_size: 1.0}))),
        ("cache_salt", lambda r, rng: setattr(r, "cache_salt", _text(rng, MAX_SALT_CHARS + 1, 4 * MAX_SALT_CHARS))),
        ("n", lambda r, rng: setattr(r, "n", rng.randint(MAX_SAMPLES + 1, 2**32 - 1))),
        ("n", lambda r, rng: (setattr(r, "temperature", 0.0), setattr(r, "n", rng.randint(2, MAX_SAMPLES)))),
    ]
    if lim.chat:
        cases += [
            ("messages", messages(lambda rng: [])),
            ("messages[0].role", messages(lambda rng: [(_text(rng, 1, 10) + "!", "hi")])),
            ("messages", messages(lambda rng: [("user", "hi")] * (lim.max_messages + 1))),
        ]
    return cases


def _unknown_field(data: bytes, rng: random.Random) -> bytes:
    number = rng.randint(100, 2**20)
    return data + bytes(_varint(number << 3)) + bytes(_varint(rng.randint(0, 2**32)))


def _varint(value: int) -> list[int]:
    out = []
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return out


def _http_body(rng: random.Random, lim: Limits, chat: bool) -> dict:
    body: dict = {"model": lim.model, "max_tokens": rng.randint(1, min(2, lim.max_new_tokens))}
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng)}]
    else:
        body["prompt"] = rng.choice([_text(rng), [rng.randrange(lim.vocab_size) for _ in range(rng.randint(1, 8))]])
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0, rng.uniform(0.01, 2.0)])
    if rng.random() < 0.3:
        body["top_p"] = rng.uniform(0.05, 1.0)
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**63 - 1)
    if rng.random() < 0.3:
        body["stop"] = rng.choice([_text(rng, 1, 6), [_text(rng, 1, 6) for _ in range(rng.randint(1, 3))]])
    if rng.random() < 0.2:
        body["stream"] = True
    if rng.random() < 0.2:
        body["unknown_" + _text(rng, 1, 5).strip()] = _text(rng)  # ignored, as OpenAI does
    return body


HTTP_INVALID: list[tuple[str, bool | None, Callable[[random.Random, Limits], object]]] = [
    # (param, chat only (True) / completions only (False) / both (None), bad value)
    ("max_tokens", None, lambda rng, lim: rng.choice([0, -rng.randint(1, 10**9), lim.max_new_tokens + 1,
                                                        "many", 1.5, [1]])),
    ("temperature", None, lambda rng, lim: rng.choice([-rng.uniform(0.01, 10), "hot", [0.5]])),
    ("top_p", None, lambda rng, lim: rng.choice([0, rng.uniform(1.01, 100), -1, "all"])),
    ("n", None, lambda rng, lim: rng.choice([0, -rng.randint(1, 9), rng.randint(MAX_SAMPLES + 1, 100), "two"])),
    ("seed", None, lambda rng, lim: rng.choice([-rng.randint(1, 10**9), "s"])),
    ("stop", None, lambda rng, lim: rng.choice([[""], ["x"] * (lim.max_stop_strings + 1), 5])),
    ("presence_penalty", None, lambda rng, lim: rng.choice([rng.uniform(2.01, 50), -rng.uniform(2.01, 50)])),
    ("frequency_penalty", None, lambda rng, lim: rng.choice([rng.uniform(2.01, 50), -rng.uniform(2.01, 50)])),
    ("repetition_penalty", None, lambda rng, lim: rng.choice([0, -rng.uniform(0.01, 5), rng.uniform(2.01, 50)])),
    ("logit_bias", None, lambda rng, lim: rng.choice([{"5": rng.uniform(100.5, 10**6)}, {"five": 1},
                                                      {str(lim.vocab_size + rng.randint(0, 99)): 1}])),
    ("speculation", None, lambda rng, lim: rng.choice(["sometimes", True, lim.max_gamma + 1, "3"])),
    ("cache_salt", None, lambda rng, lim: rng.choice([_text(rng, MAX_SALT_CHARS + 1, 2 * MAX_SALT_CHARS), 5, ["s"]])),
    ("top_k", None, lambda rng, lim: rng.randint(-100, -2)),
    ("min_tokens", None, lambda rng, lim: rng.choice([-rng.randint(1, 10**6), 3 + rng.randint(0, 10**6)])),
    ("logprobs", False, lambda rng, lim: rng.choice([lim.max_top_logprobs + 1, "yes"])),
    ("prompt", False, lambda rng, lim: rng.choice(["", [], [lim.vocab_size + rng.randint(0, 9)], None, ["a", "b"]])),
    ("best_of", False, lambda rng, lim: rng.randint(2, 10)),
    ("suffix", False, lambda rng, lim: "end"),
    ("messages", True, lambda rng, lim: rng.choice([[], "hi", None])),
    ("messages[0].role", True, lambda rng, lim: [{"role": _text(rng, 1, 8) + "!", "content": "hi"}]),
    ("max_completion_tokens", True, lambda rng, lim: rng.choice([0, lim.max_new_tokens + 1])),
    ("top_logprobs", True, lambda rng, lim: rng.randint(1, 5)),  # without logprobs
    ("tools[0].function.name", True, lambda rng, lim: [{"type": "function", "function": {
        "name": rng.choice(["", "a b", "x" * 65, _text(rng, 1, 8) + "!"])}}]),
    ("tools[0].function.parameters", True, lambda rng, lim: [{"type": "function", "function": {
        "name": "f", "parameters": rng.choice([{"type": "nope"}, {"type": "object", "properties": {"a": 5}}])}}]),
    ("tool_choice", True, lambda rng, lim: rng.choice(["required", "sometimes"])),  # without tools
    ("response_format.type", True, lambda rng, lim: {"type": rng.choice(["xml", "yaml", ""])}),
]


def make_cases(seed: int, count: int, lim: Limits, http: bool) -> list[Case]:
    """`count` cases, the same for the same seed and limits."""
    rng = random.Random(seed)
    kinds = [k for k in (KINDS if http else GRPC_KINDS) if lim.chat or k not in ("http-tools", "grpc-tools")]
    mutations = _invalid_mutations(lim)
    cases = []
    for _ in range(count):
        kind = rng.choice(kinds)
        stream = rng.random() < 0.3
        if kind == "grpc-valid":
            cases.append(Case(kind, _valid(rng, lim).SerializeToString(), frozenset([OK]), stream=stream))
        elif kind == "grpc-constraint":
            req = _valid(rng, lim)
            req.min_tokens = 0  # not with a constraint
            which, value = random_constraint(rng)
            if which == "choice":
                req.constraint.choice.choices.extend(value)
            else:
                setattr(req.constraint, which, value)
            cases.append(Case(kind, req.SerializeToString(), frozenset([OK, INVALID]), f"constraint.{which}",
                              stream=stream))
        elif kind == "grpc-tools":
            cases.append(Case(kind, _with_tools(rng, lim).SerializeToString(), frozenset([OK, INVALID]), stream=stream))
        elif kind == "grpc-invalid":
            req = _valid(rng, lim)
            name, breaks = rng.choice(mutations)
            breaks(req, rng)
            cases.append(Case(kind, req.SerializeToString(), frozenset([INVALID]), name, stream=stream))
        elif kind == "grpc-bytes":
            data = _valid(rng, lim).SerializeToString()
            how = rng.choice(["random", "truncate", "flip", "unknown"])
            if how == "random":
                data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 256)))
            elif how == "truncate" and len(data) > 1:
                data = data[:rng.randrange(1, len(data))]
            elif how == "flip" and data:
                flipped = bytearray(data)
                for _ in range(rng.randint(1, 4)):
                    flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
                data = bytes(flipped)
            else:
                data = _unknown_field(data, rng)
            field_named = "request" if how == "unknown" else None
            expected = frozenset([INVALID]) if how == "unknown" else frozenset([OK, INVALID])
            cases.append(Case(kind, data, expected, field_named, stream=stream))
        else:
            chat = lim.chat and (kind == "http-tools" or rng.random() < 0.5)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = _http_body(rng, lim, chat)
            if kind == "http-tools":
                body |= random_tools_body(rng)
                cases.append(Case(kind, json.dumps(body).encode(), frozenset(["200", "400"]), path=path))
            elif kind == "http-valid":
                cases.append(Case(kind, json.dumps(body).encode(), frozenset(["200"]), path=path))
            elif kind == "http-invalid":
                if rng.random() < 0.08:
                    body["model"] = _text(rng, 1, 12) + "-other"
                    cases.append(Case(kind, json.dumps(body).encode(), frozenset(["404"]), "model", path))
                    continue
                options = [m for m in HTTP_INVALID if m[1] is None or m[1] == chat]
                param, _, bad = rng.choice(options)
                value = bad(rng, lim)
                key = param.split("[", 1)[0].split(".", 1)[0]  # the body's field: messages, tools, ...
                body[key] = value
                if key == "max_completion_tokens":
                    body.pop("max_tokens", None)
                cases.append(Case(kind, json.dumps(body).encode(), frozenset(["400"]),
                                  _expected_param(param, value), path))
            else:
                data = json.dumps(body).encode()
                how = rng.choice(["random", "truncate", "flip"])
                if how == "random":
                    data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
                elif how == "truncate":
                    data = data[:rng.randrange(0, len(data))]
                else:
                    flipped = bytearray(data)
                    for _ in range(rng.randint(1, 3)):
                        flipped[rng.randrange(len(flipped))] = rng.getrandbits(8)
                    data = bytes(flipped)
                cases.append(Case(kind, data, frozenset(["200", "400", "404"]), None, path))
    return cases


def _with_tools(rng: random.Random, lim: Limits) -> generation_pb2.GenerateRequest:
    """A valid chat request given random tools (tools/reliability/fuzz_constraints.py's, some
    broken), tool_choice and parallel_tool_calls, sometimes after an earlier call of one of them."""
    req = _valid(rng, lim)
    req.min_tokens = 0  # not with a constraint
    req.ClearField("constraint")
    req.messages.SetInParent()
    if not req.messages.messages:
        req.messages.messages.add(role="user", content=_text(rng, 1))
    body = random_tools_body(rng)
    for tool in body.get("tools", []):
        function = tool["function"]
        req.tools.add(name=function["name"], description=function.get("description", ""),
                      parameters=json.dumps(function["parameters"]))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name", choice.get("type", ""))
    if choice is not None:
        req.tool_choice = str(choice)
    if "parallel_tool_calls" in body:
        req.parallel_tool_calls = body["parallel_tool_calls"]
    if req.tools and rng.random() < 0.3:
        call = generation_pb2.ToolCall(id="call_1", name=rng.choice(req.tools).name,
                                       arguments=rng.choice(['{"arg":1}', "{}", "not json"]))
        req.messages.messages.add(role=rng.choice(["assistant", "assistant", "user"]), tool_calls=[call])
        req.messages.messages.add(role="tool", tool_call_id="call_1", content=_text(rng, 1))
    return req


def _expected_param(param: str, value: object) -> str:
    """Where a pydantic type error names a nested location, the first part is what the caller sent."""
    if param == "messages" and value == "hi":
        return "messages"
    if param == "stop" and value == [""]:
        return "stop"
    return param


# --- running ---------------------------------------------------------------------------------------

async def _grpc_call(channel: grpc.aio.Channel, case: Case) -> tuple[str, str | None]:
    method = "/specstream.v1.Generation/GenerateStream" if case.stream else "/specstream.v1.Generation/Generate"
    identity = lambda b: b  # noqa: E731
    try:
        if case.stream:
            call = channel.unary_stream(method, request_serializer=identity, response_deserializer=identity)
            async for _ in call(case.payload, timeout=120):
                pass
        else:
            call = channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)
            await call(case.payload, timeout=120)
        return OK, None
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
        named = details.split("=", 1)[0].split(":", 1)[0] if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else None
        return exc.code().name, named


async def _http_call(host: str, port: int, case: Case) -> tuple[str, str | None]:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return "CONNECTION", None
    head = (f"POST {case.path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(case.payload)}\r\n\r\n").encode()
    writer.write(head + case.payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 120)
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2:
        return "CONNECTION", None
    status = parts[1].decode()
    named = None
    if status != "200":
        body = rest.partition(b"\r\n\r\n")[2]
        try:
            named = json.loads(body)["error"]["param"]
        except (ValueError, KeyError, TypeError):
            named = None
    return status, named


async def run_cases(cases: list[Case], grpc_address: str, http_address: str | None = None,
                    concurrency: int = 8, progress: Progress | None = None) -> list[Outcome]:
    """Each case's outcome, in case order, ``concurrency`` at a time; ``progress`` counts each answered case."""
    outcomes: list[Outcome | None] = [None] * len(cases)
    gate = asyncio.Semaphore(concurrency)
    host, _, port = (http_address or ":0").rpartition(":")
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        async def one(i: int, case: Case) -> None:
            async with gate:
                start = time.monotonic()
                if case.kind.startswith("grpc"):
                    got, named = await _grpc_call(channel, case)
                else:
                    got, named = await _http_call(host, int(port), case)
                outcomes[i] = Outcome(case, got, named, time.monotonic() - start)
                if progress is not None:
                    progress.update()

        await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)))
    return [o for o in outcomes if o is not None]


async def limits_of(grpc_address: str) -> Limits:
    from specstream_client import AsyncClient

    async with AsyncClient(grpc_address, timeout=30) as client:
        info = await client.model_info()
    return Limits(vocab_size=info.vocab_size, max_new_tokens=info.max_new_tokens_limit, max_gamma=info.max_gamma,
                  max_context=info.max_context_length, chat=info.has_chat_template, model=info.target_model)


async def serving(grpc_address: str) -> bool:
    from specstream_client import AsyncClient
    from specstream_client.errors import SpecstreamError

    try:
        async with AsyncClient(grpc_address, timeout=60) as client:
            result = await client.generate("hello", max_new_tokens=1)
        return result.usage.completion_tokens == 1
    except SpecstreamError:
        return False


async def fuzz(grpc_address: str, http_address: str | None = None, cases: int = 1000, seed: int = 0,
               concurrency: int = 8, quiet: bool = False) -> Report:
    """Runs `cases` fuzzed requests against a running gateway; the report counts crashes and
    wrong codes and keeps the first few of each. Progress on stderr (tools.progress;
    ``quiet``: plain lines, never a bar), counted in cases."""
    lim = await limits_of(grpc_address)
    made = make_cases(seed, cases, lim, http=http_address is not None)
    start = time.monotonic()
    with Progress(len(made), "cases", "fuzz", quiet=quiet) as progress:
        outcomes = await run_cases(made, grpc_address, http_address, concurrency, progress)
    seconds = time.monotonic() - start
    bad = [o for o in outcomes if o.crash or o.wrong]
    return Report(
        seed=seed, cases=len(outcomes), by_kind=dict(Counter(o.case.kind for o in outcomes)),
        outcomes=dict(Counter(f"{o.case.kind} {o.got}" for o in outcomes)),
        crashes=sum(o.crash for o in outcomes), wrong=sum(o.wrong and not o.crash for o in outcomes),
        examples=[{"kind": o.case.kind, "expected": sorted(o.case.expected), "field": o.case.field, "got": o.got,
                   "named": o.named, "payload": o.case.payload[:200].hex(), "path": o.case.path}
                  for o in bad[:10]],
        seconds=seconds, serving_after=await serving(grpc_address))
