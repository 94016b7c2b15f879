"""Building ``GenerateRequest`` messages and resolving targets/timeouts; shared by ``Client`` and
``AsyncClient``.

Contract: local checks are limited to what the wire format needs (types, and values that cannot be
encoded at all: an int outside its int32/uint64 field, a negative seed); ranges the server decides
(max_new_tokens limits, gamma limits, stop-string counts, temperature >= 0, top_p in (0, 1],
top_logprobs limits and its need for logprobs=True) are sent as given and rejected by the server
with INVALID_ARGUMENT. Errors here are raised before any RPC, as ``ValueError`` (bad value) or
``TypeError`` (wrong type).

What it does not know: the server's limits and its tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from specstream_pb import common_pb2, generation_pb2

__all__ = ["GenerateOptions", "build_chat_request", "build_generate_request", "parse_target", "resolve_timeout"]

_INT32_MAX = 2**31 - 1
_INT32_MIN = -(2**31)
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def parse_target(url: str) -> tuple[str, bool]:
    """``"host:port"``, ``"grpc://host:port"`` or ``"grpcs://host:port"`` -> (target, use_tls)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"url must be 'host:port' or 'grpc://host:port', got {url!r}")
    url = url.strip()
    tls = False
    if "://" in url:
        scheme, _, rest = url.partition("://")
        scheme = scheme.lower()
        if scheme == "grpcs":
            tls = True
        elif scheme != "grpc":
            raise ValueError(f"url scheme must be grpc:// or grpcs://, got {url!r}")
        url = rest.rstrip("/")
    if not url or "/" in url:
        raise ValueError(f"url must be 'host:port' or 'grpc://host:port', got {url!r}")
    return url, tls


def resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    value = default if timeout is None else timeout
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"timeout must be a number of seconds or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value!r}")
    return float(value)


def _uint32_list(name: str, values: Any) -> list[int]:
    if isinstance(values, str | bytes | bytearray) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out: list[int] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
        iv = int(v.__index__())  # numpy integers included
        if not 0 <= iv <= _UINT32_MAX:
            raise ValueError(f"{name}[{i}] must be a token id in 0..{_UINT32_MAX}, got {iv}")
        out.append(iv)
    return out


def _int_field(name: str, value: Any, lo: int, hi: int, kind: str) -> int:
    """An int (numpy integers included, bool not) that the wire can carry in ``lo..hi``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    iv = int(value.__index__())
    if not lo <= iv <= hi:
        raise ValueError(f"{name} must fit in {kind} ({lo}..{hi}), got {iv}")
    return iv


def _float_field(name: str, value: Any) -> float:
    # NaN, inf and out-of-range values are sent as given: the server names them.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _speculation(speculation: str | int) -> common_pb2.Speculation:
    # bool is an int subclass; True meaning "gamma 1" would be a silent surprise.
    if isinstance(speculation, str):
        if speculation == "auto":
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_AUTO)
        if speculation == "off":
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_OFF)
    elif isinstance(speculation, int) and not isinstance(speculation, bool):
        if speculation == 0:
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_OFF)
        if 0 < speculation <= _UINT32_MAX:
            return common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_FIXED, gamma=speculation)
    raise ValueError(
        f"speculation must be 'auto', 'off', 0 or a positive int gamma, got {speculation!r}"
    )


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of ``generate`` (see ``Client.generate``), shared by ``chat``."""

    max_new_tokens: int
    speculation: str | int
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


def build_chat_request(messages: Sequence[Mapping[str, str]], **options: Any) -> generation_pb2.GenerateRequest:
    """The request for ``chat``/``chat_stream``: ``messages`` is a sequence of
    ``{"role": ..., "content": ...}`` mappings; roles and template rules are the server's to check."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a sequence of {{'role': str, 'content': str}} mappings, "
                        f"got {type(messages).__name__}")
    req = build_generate_request("", **options)
    chat = generation_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a mapping with 'role' and 'content', got {message!r}")
        extra = set(message) - {"role", "content"}
        if extra:
            raise ValueError(f"messages[{i}] has unsupported keys {sorted(extra)} (only 'role' and 'content')")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {message.get(key)!r}")
        chat.messages.add(role=message["role"], content=message["content"])
    req.messages.CopyFrom(chat)  # selects the `messages` member of the input oneof
    return req


def build_generate_request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 64,
    speculation: str | int = "auto",
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    request_id: str | None = None,
    traceparent: str | None = None,
) -> generation_pb2.GenerateRequest:
    """The request for ``generate``/``generate_stream``; see ``Client.generate`` for the fields."""
    req = generation_pb2.GenerateRequest()

    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be str or a sequence of token ids, not bytes")
    else:
        req.prompt_token_ids.ids.extend(_uint32_list("prompt", prompt))
        # An empty id list must still select the oneof, so the server sees "token ids, none".
        req.prompt_token_ids.SetInParent()

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if not _INT32_MIN <= max_new_tokens <= _INT32_MAX:
        raise ValueError(f"max_new_tokens must fit in int32, got {max_new_tokens}")
    req.max_new_tokens = max_new_tokens

    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if isinstance(stops, bytes | bytearray) or not isinstance(stops, Sequence):
            raise TypeError(f"stop must be a str or a sequence of str, got {type(stop).__name__}")
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise TypeError(f"stop[{i}] must be a str, got {s!r}")
        req.stop.extend(stops)

    if stop_token_ids is not None:
        req.stop_token_ids.extend(_uint32_list("stop_token_ids", stop_token_ids))

    if not isinstance(ignore_eos, bool):
        raise TypeError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    req.ignore_eos = ignore_eos

    req.speculation.CopyFrom(_speculation(speculation))

    req.temperature = _float_field("temperature", temperature)
    req.top_k = _int_field("top_k", top_k, _INT32_MIN, _INT32_MAX, "int32")
    if top_p is not None:  # unset means 1 (off); only a set value is sent
        req.top_p = _float_field("top_p", top_p)
    if seed is not None:  # unset: the server picks one and returns it
        req.seed = _int_field("seed", seed, 0, _UINT64_MAX, "uint64")
    if not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be a bool, got {logprobs!r}")
    req.logprobs = logprobs
    req.top_logprobs = _int_field("top_logprobs", top_logprobs, _INT32_MIN, _INT32_MAX, "int32")

    if request_id is not None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        req.request_id = request_id
    if traceparent is not None:
        if not isinstance(traceparent, str):
            raise TypeError(f"traceparent must be a str, got {traceparent!r}")
        req.traceparent = traceparent
    return req
