"""The generation options of every ``generate``/``chat`` call, defined once.

Contract: ``GenerateOptions`` is the one definition of the options -- each field's name, type,
default, wire check and meaning (the comment above it) -- and ``GenerateOptions.to_pb`` is their
mapping onto a ``GenerateRequest``. ``Client`` and ``AsyncClient`` (``generate``,
``generate_stream``, ``chat``, ``chat_stream``) take a ``GenerateOptions`` and/or the same options
as keyword arguments, which override its fields. ``GenerateOptionsDict`` types those keywords for
type checkers; it mirrors the fields because Python cannot derive one from the other (a test keeps
them equal).

Local checks are limited to what the wire format needs: types, values a field cannot encode (an
int outside its int32/uint32/uint64 field, a negative seed, ``max_gamma=0``, which the wire reads
as "the server's limit"), and ``max_gamma`` without automatic speculation, which the request
cannot express. Ranges the server decides (max_new_tokens limits, gamma and max_gamma limits,
stop-string counts, temperature >= 0, top_p in (0, 1], top_logprobs limits and its need for
logprobs=True) are sent as given and rejected by the server with INVALID_ARGUMENT. Errors are
raised when a ``GenerateOptions`` is made, so before any RPC: ``ValueError`` (a bad value, quoted)
or ``TypeError`` (a wrong type, or an unknown option), naming the option.

Adding an option: a field of ``GenerateOptions`` (type, default, check, comment), its line in
``to_pb``, and its line in ``GenerateOptionsDict``.

What it does not know: the server's limits (``model_info()``), its tokenizer, and the call's
deadline (``timeout`` is an argument of each call, not a request field).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

from specstream_pb import common_pb2, generation_pb2

from ._wire import (
    INT32_MAX,
    INT32_MIN,
    UINT32_MAX,
    UINT64_MAX,
    check_bool,
    check_float,
    check_int,
    check_str,
    check_token_ids,
)

__all__ = ["GenerateOptions", "GenerateOptionsDict", "resolve_options"]

_Check = Callable[[str, Any], Any]  # (option name, value) -> the value to store; raises on a bad one


def _option(default: Any, check: _Check) -> Any:
    """A field whose value ``__post_init__`` passes through ``check``."""
    return field(default=default, metadata={"check": check})


def _optional(check: _Check) -> _Check:
    def optional(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return optional


def _int32(name: str, value: Any) -> int:
    return check_int(name, value, INT32_MIN, INT32_MAX, "int32")


def _uint32(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT32_MAX, "uint32")


def _uint64(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT64_MAX, "uint64")


def _stop(name: str, value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else value
    if isinstance(stops, bytes | bytearray) or not isinstance(stops, Sequence):
        raise TypeError(f"{name} must be a str or a sequence of str, got {type(value).__name__}")
    return tuple(check_str(f"{name}[{i}]", s) for i, s in enumerate(stops))


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    return tuple(check_token_ids(name, value))


def _speculation(name: str, value: Any) -> str | int:
    # bool is an int subclass; True meaning "gamma 1" would be a silent surprise.
    if isinstance(value, str) and value in ("auto", "off"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT32_MAX:
        return value
    raise ValueError(f"{name} must be 'auto', 'off', 0 or a positive int gamma, got {value!r}")


_EARLY_STOPPING = {False: "EARLY_STOPPING_HEURISTIC", "heuristic": "EARLY_STOPPING_HEURISTIC",
                   True: "EARLY_STOPPING_FIRST_K", "first_k": "EARLY_STOPPING_FIRST_K", "never": "EARLY_STOPPING_NEVER"}


def _early_stopping(name: str, value: Any) -> bool | str:
    if (isinstance(value, bool) or isinstance(value, str)) and value in _EARLY_STOPPING:
        return value
    raise ValueError(f"{name} must be False/'heuristic', True/'first_k' or 'never', got {value!r}")


def _json_schema(name: str, value: Any) -> str:
    """A schema as a mapping (sent as its JSON text, key order kept) or as JSON text."""
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    return check_str(name, value)


def _choices(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of strings, got {type(value).__name__}")
    for item in value:
        check_str(name, item)
    return tuple(value)


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """token id -> bias; ids as ints or as OpenAI's strings of digits (ranges: the server's)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of token id to bias, got {type(value).__name__}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        out[check_int(f"{name} key", token, 0, UINT32_MAX, "uint32")] = check_float(f"{name}[{key}]", bias)
    return out


def _tools(name: str, value: Any) -> tuple[tuple[str, str, str], ...]:
    """Functions the model may call, each ``{"name", "description", "parameters"}`` (parameters: a
    JSON schema as a mapping or its JSON text; left out: no arguments) or OpenAI's
    ``{"type": "function", "function": {...}}``; stored as (name, description, parameters' text)."""
    if isinstance(value, str | Mapping) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of function mappings, got {type(value).__name__}")
    out = []
    for i, tool in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(tool, Mapping):
            raise TypeError(f"{at} must be a mapping with name, description and parameters, got {tool!r}")
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            tool, at = tool["function"], f"{at}.function"
        extra = set(tool) - {"name", "description", "parameters"}
        if extra:
            raise ValueError(f"{at} has unsupported keys {sorted(extra)} (name, description, parameters)")
        parameters = tool.get("parameters")
        text = json.dumps(dict(parameters)) if isinstance(parameters, Mapping) else \
            check_str(f"{at}.parameters", parameters) if parameters is not None else ""
        out.append((check_str(f"{at}.name", tool.get("name")),
                    check_str(f"{at}.description", tool.get("description", "")), text))
    return tuple(out)


def _max_gamma(name: str, value: Any) -> int:
    cap = check_int(name, value, 0, UINT32_MAX, "uint32")
    if cap == 0:
        # The wire's 0 is "unset": sent, it would let the controller go up to the server's limit.
        raise ValueError(f"{name} must be >= 1, got 0 (None: the server's limit; speculation='off': no draft)")
    return cap


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """How to generate: the options of ``generate``, ``generate_stream``, ``chat`` and
    ``chat_stream``, as one checked, reusable value.

    ``client.generate(prompt, max_new_tokens=8)`` and
    ``client.generate(prompt, GenerateOptions(max_new_tokens=8))`` send the same request; keywords
    given next to an object override its fields (``client.generate(prompt, opts, seed=3)``).
    Values are checked when the object is made (see the module docstring); ``stop`` and
    ``stop_token_ids`` are stored as tuples.
    """

    # Most tokens to generate; 1..the server's limit (``ModelInfo.max_new_tokens_limit``).
    max_new_tokens: int = _option(64, _int32)
    # "auto": the server's controller picks gamma (draft tokens per step) each step; "off" or 0:
    # plain decoding; an int gamma > 0: exactly that many draft tokens per step
    # (1..``ModelInfo.max_gamma``).
    speculation: str | int = _option("auto", _speculation)
    # With speculation="auto" only: the most draft tokens the controller may pick per step, >= 1
    # (a cap above ``ModelInfo.max_gamma`` is the server's to judge). None: the server's limit.
    # With speculation "off" or a fixed gamma it is a ValueError, raised here.
    max_gamma: int | None = _option(None, _optional(_max_gamma))
    # One stop string or several; generation ends at the first match, which the text leaves out.
    stop: str | Sequence[str] | None = _option(None, _optional(_stop))
    # Token ids that end generation (each < the vocabulary size).
    stop_token_ids: Sequence[int] | None = _option(None, _optional(_token_ids))
    # Keep generating past the model's end-of-sequence token(s).
    ignore_eos: bool = _option(False, check_bool)
    # 0: greedy (argmax); > 0: sample from softmax(logits / temperature).
    temperature: float = _option(0.0, check_float)
    # When sampling: keep only the k most likely tokens; 0: all.
    top_k: int = _option(0, _int32)
    # When sampling: keep the smallest most-likely set with mass >= top_p, in (0, 1]; None: 1 (all).
    top_p: float | None = _option(None, _optional(check_float))
    # Makes sampling reproducible (0..2**64-1); None: the server picks one and reports it as `.seed`.
    seed: int | None = _option(None, _optional(_uint64))
    # Return each generated token's log-probability (``.logprobs``).
    logprobs: bool = _option(False, check_bool)
    # With logprobs=True: also the n most likely alternatives per token (0..the server's limit).
    top_logprobs: int = _option(0, _int32)
    # Names the request in results, logs and metrics; None: the gateway assigns one.
    request_id: str | None = _option(None, _optional(check_str))
    # W3C trace context of the caller, to join its trace.
    traceparent: str | None = _option(None, _optional(check_str))
    # Beam search with this many beams k (1..the server's slots); None: one sequence. Greedy only:
    # with temperature, top_k, top_p, a fixed gamma, logprobs or stop strings the server answers
    # INVALID_ARGUMENT. The result's text is the best hypothesis'; ``.sequences`` has the n best.
    num_beams: int | None = _option(None, _optional(_int32))
    # With num_beams: how many of the best finished hypotheses to return (1..num_beams); None: 1.
    num_return_sequences: int | None = _option(None, _optional(_int32))
    # With num_beams: score = sum of logprobs / length ** length_penalty (> 0 favours longer); None: 1.
    length_penalty: float | None = _option(None, _optional(check_float))
    # With num_beams: when the search ends, as transformers' early_stopping: False or "heuristic"
    # (its default), True or "first_k" (once num_beams hypotheses finished), "never". None: heuristic.
    early_stopping: bool | str | None = _option(None, _optional(_early_stopping))
    # With num_beams: variable width, pruning hypotheses more than this below the best
    # log-probability (> 0). None: no pruning (fixed width).
    beam_threshold: float | None = _option(None, _optional(check_float))
    # With num_beams: at most this many hypotheses extend one parent per step (1..num_beams). None: num_beams.
    max_candidates_per_parent: int | None = _option(None, _optional(_int32))
    # EOS, stop_token_ids and stop strings cannot end generation before this many tokens
    # (0..max_new_tokens; 0: off). Not with num_beams.
    min_tokens: int = _option(0, _uint32)
    # Structured output, at most one of the five: the text is JSON valid against this JSON schema
    # (a mapping, or its JSON text), any JSON object, a full match of this regular expression,
    # one of these strings, or a sentence of this Lark grammar. The server compiles it against the
    # model's tokenizer (a bad one is INVALID_ARGUMENT with the compiler's reason); generation ends
    # where the constraint is complete ("stop"), or with "length" if the budget ends it first.
    json_schema: Mapping[str, Any] | str | None = _option(None, _optional(_json_schema))
    json_object: bool = _option(False, check_bool)
    regex: str | None = _option(None, _optional(check_str))
    choice: Sequence[str] | None = _option(None, _optional(_choices))
    grammar: str | None = _option(None, _optional(check_str))
    # Adjustments of the logits at every position, as OpenAI's and vLLM's (ranges: the server's):
    # presence_penalty and frequency_penalty (-2..2) over the generated tokens, repetition_penalty
    # ((0, 2]; 1: off) over the prompt's and the generated tokens, logit_bias {token id: -100..100}.
    # Exact under speculation. Not with num_beams.
    presence_penalty: float = _option(0.0, check_float)
    frequency_penalty: float = _option(0.0, check_float)
    repetition_penalty: float = _option(1.0, check_float)
    logit_bias: Mapping[int, float] | None = _option(None, _optional(_logit_bias))
    # Tool calling, with chat only: the functions the model may call (see ``_tools`` for their
    # form); its calls come back as ``.tool_calls`` (outside ``.text``), each call's arguments
    # valid against its function's parameters, and an answer that ends after calls finishes with
    # "tool_calls". tool_choice: "auto" (the default with tools), "none", "required", or one
    # function's name; parallel_tool_calls (None: True): several calls in one answer.
    tools: Sequence[Mapping[str, Any]] | None = _option(None, _optional(_tools))
    tool_choice: str | None = _option(None, _optional(check_str))
    parallel_tool_calls: bool | None = _option(None, _optional(check_bool))
    # Prompts reuse the server's cached K/V of an earlier prompt's prefix only under the same salt
    # (at most 256 characters; None: the default, shared by every caller of the same token).
    cache_salt: str | None = _option(None, _optional(check_str))
    # Samples of the prompt (1..16; more than 1 needs a temperature above 0, and not num_beams): n
    # answers drawn with seeds seed + i, prefilled once on the server. The result's ``.samples``
    # has them all (its text is the first's); a stream's chunks say whose they are (``.index``).
    n: int = _option(1, _uint32)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        constrained = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(constrained) > 1:
            raise ValueError(f"{constrained[1]} cannot be combined with {constrained[0]}: one constraint per request")
        if self.repetition_penalty == 0:  # the wire's 0 means "off": refused here rather than ignored
            raise ValueError("repetition_penalty must be in (0, 2] (1: off), got 0")
        if self.max_gamma is not None and self.speculation != "auto":
            raise ValueError(
                f"max_gamma={self.max_gamma} caps automatic speculation and needs speculation='auto', "
                f"got speculation={self.speculation!r}; drop max_gamma or use speculation='auto'"
            )

    def to_pb(self) -> generation_pb2.GenerateRequest:
        """A ``GenerateRequest`` carrying these options and no input (the caller sets the prompt
        or the messages)."""
        req = generation_pb2.GenerateRequest(
            max_new_tokens=self.max_new_tokens,
            speculation=self._speculation_pb(),
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            top_k=self.top_k,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            request_id=self.request_id or "",
            traceparent=self.traceparent or "",
            min_tokens=self.min_tokens,
        )
        if self.top_p is not None:  # unset means 1 (off); only a set value is sent
            req.top_p = self.top_p
        if self.seed is not None:  # unset: the server picks one and returns it
            req.seed = self.seed
        if any(getattr(self, name) is not None for name in _BEAM_OPTIONS):
            # A beam option without num_beams is sent too: the server names num_beams as missing.
            req.beam.CopyFrom(self._beam_pb())
        for name in _CONSTRAINTS:
            value = getattr(self, name)
            if name == "choice" and value is not None:
                req.constraint.choice.choices.extend(value)
            elif value not in (None, False):
                setattr(req.constraint, name, value)
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias:
            req.penalties.CopyFrom(common_pb2.Penalties(
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=0.0 if self.repetition_penalty == 1.0 else self.repetition_penalty,
                logit_bias=self.logit_bias or {}))
        for name, description, parameters in self.tools or ():
            req.tools.add(name=name, description=description, parameters=parameters)
        if self.tool_choice is not None:
            req.tool_choice = self.tool_choice
        if self.parallel_tool_calls is not None:
            req.parallel_tool_calls = self.parallel_tool_calls
        if self.cache_salt is not None:
            req.cache_salt = self.cache_salt
        if self.n != 1:  # 0 is sent too: the server names n
            req.n = self.n
        return req

    def _beam_pb(self) -> common_pb2.BeamSearch:
        beam = common_pb2.BeamSearch(
            num_beams=self.num_beams or 0, num_return_sequences=self.num_return_sequences or 0,
            max_candidates_per_parent=self.max_candidates_per_parent or 0,
            early_stopping=common_pb2.EarlyStopping.Value(_EARLY_STOPPING[self.early_stopping])
            if self.early_stopping is not None else common_pb2.EARLY_STOPPING_UNSPECIFIED)
        if self.length_penalty is not None:
            beam.length_penalty = self.length_penalty
        if self.beam_threshold is not None:
            beam.beam_threshold = self.beam_threshold
        return beam

    def _speculation_pb(self) -> common_pb2.Speculation:
        if self.speculation == "auto":
            # max_gamma 0 on the wire: the server's limit.
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_AUTO, max_gamma=self.max_gamma or 0)
        if self.speculation in ("off", 0):
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_OFF)
        assert isinstance(self.speculation, int)  # all that _speculation lets through
        return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_FIXED, gamma=self.speculation)


class GenerateOptionsDict(TypedDict, total=False):
    """``GenerateOptions``' fields as keyword arguments, for type checkers
    (``**overrides: Unpack[GenerateOptionsDict]``); the same names and types, documented there."""

    max_new_tokens: int
    speculation: str | int
    max_gamma: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    temperature: float
    top_k: int
    top_p: float | None
    seed: int | None
    logprobs: bool
    top_logprobs: int
    request_id: str | None
    traceparent: str | None
    num_beams: int | None
    num_return_sequences: int | None
    length_penalty: float | None
    early_stopping: bool | str | None
    beam_threshold: float | None
    max_candidates_per_parent: int | None
    min_tokens: int
    json_schema: Mapping[str, Any] | str | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | None
    parallel_tool_calls: bool | None
    cache_salt: str | None
    n: int


_CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")  # the oneof of GenerateRequest.constraint
_BEAM_OPTIONS = ("num_beams", "num_return_sequences", "length_penalty", "early_stopping", "beam_threshold",
                 "max_candidates_per_parent")
_NAMES = tuple(f.name for f in fields(GenerateOptions))


def resolve_options(options: GenerateOptions | None, overrides: Mapping[str, Any]) -> GenerateOptions:
    """The options of one call: ``options`` (None: the defaults) with the keyword ``overrides``
    replacing its fields, checked."""
    for name in overrides:
        if name not in _NAMES:
            close = difflib.get_close_matches(name, _NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unexpected keyword argument {name!r}{hint}; the options are {', '.join(_NAMES)}")
    if options is None:
        return GenerateOptions(**overrides)
    if not isinstance(options, GenerateOptions):
        raise TypeError(f"options must be a GenerateOptions (or pass the options as keywords), "
                        f"got {type(options).__name__}")
    return replace(options, **overrides) if overrides else options
