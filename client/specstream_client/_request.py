"""Building ``GenerateRequest`` messages: the one implementation behind ``Client`` and
``AsyncClient``'s ``generate``, ``generate_stream``, ``chat`` and ``chat_stream``.

Contract: a request is its input (a prompt, or chat messages) plus a ``GenerateOptions``
(see ``options.py``, which defines the options, their checks and their fields on the wire). Local
checks are limited to what the wire format needs; the input is checked here, the options there.
Errors are raised before any RPC, as ``ValueError`` (bad value) or ``TypeError`` (wrong type).

What it does not know: the server's limits and its tokenizer, and the call (deadline, metadata:
``_call.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from specstream_pb import generation_pb2

from ._wire import check_token_ids
from .options import GenerateOptions, resolve_options
from .types import ToolCall

if TYPE_CHECKING:
    # For type checkers only: typing_extensions is not a runtime dependency of the SDK (grpcio and
    # protobuf are), and `from __future__ import annotations` leaves the annotations unevaluated.
    from typing_extensions import Unpack

    from .options import GenerateOptionsDict

__all__ = ["build_chat_request", "build_generate_request"]


def build_generate_request(
    prompt: str | Sequence[int], options: GenerateOptions | None = None, **overrides: Unpack[GenerateOptionsDict]
) -> generation_pb2.GenerateRequest:
    """The request for ``generate``/``generate_stream``: ``prompt`` is text or token ids; the
    options are ``options`` with ``overrides`` replacing its fields (see ``resolve_options``)."""
    req = resolve_options(options, overrides).to_pb()
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be str or a sequence of token ids, not bytes")
    else:
        req.prompt_token_ids.ids.extend(check_token_ids("prompt", prompt))
        # An empty id list must still select the oneof, so the server sees "token ids, none".
        req.prompt_token_ids.SetInParent()
    return req


def build_chat_request(
    messages: Sequence[Mapping[str, Any]],
    options: GenerateOptions | None = None,
    **overrides: Unpack[GenerateOptionsDict],
) -> generation_pb2.GenerateRequest:
    """The request for ``chat``/``chat_stream``: ``messages`` is a sequence of
    ``{"role": ..., "content": ...}`` mappings; an assistant's may hold its earlier ``tool_calls``
    (``ToolCall`` results, ``{"id", "name", "arguments"}`` or OpenAI's ``{"id", "function": {...}}``;
    its content may then be None) and a tool's the ``tool_call_id`` it answers. Roles and template
    rules are the server's to check. Options as in ``build_generate_request``."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a sequence of {{'role': str, 'content': str}} mappings, "
                        f"got {type(messages).__name__}")
    req = resolve_options(options, overrides).to_pb()
    chat = generation_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a mapping with 'role' and 'content', got {message!r}")
        extra = set(message) - {"role", "content", "tool_calls", "tool_call_id"}
        if extra:
            raise ValueError(f"messages[{i}] has unsupported keys {sorted(extra)} "
                             "(only 'role', 'content', 'tool_calls' and 'tool_call_id')")
        calls = [_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(message.get("tool_calls") or ())]
        content = message.get("content")
        if content is None and calls:
            content = ""
        for key, value in (("role", message.get("role")), ("content", content),
                           ("tool_call_id", message.get("tool_call_id", ""))):
            if not isinstance(value, str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {value!r}")
        chat.messages.add(role=message["role"], content=content, tool_calls=calls,
                          tool_call_id=message.get("tool_call_id", ""))
    req.messages.CopyFrom(chat)  # selects the `messages` member of the input oneof
    return req


def _call(at: str, call: Any) -> generation_pb2.ToolCall:
    """An earlier call: a ``ToolCall`` (a result's), or a mapping in either form."""
    if isinstance(call, ToolCall):
        return generation_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    if not isinstance(call, Mapping):
        raise TypeError(f"{at} must be a ToolCall or a mapping with name and arguments, got {call!r}")
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(dict(arguments))
    for key, value in (("name", function.get("name")), ("arguments", arguments), ("id", call.get("id", ""))):
        if not isinstance(value, str):
            raise TypeError(f"{at}[{key!r}] must be a str, got {value!r}")
    return generation_pb2.ToolCall(id=call.get("id", ""), name=function["name"], arguments=arguments)
