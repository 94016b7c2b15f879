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

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from specstream_pb import generation_pb2

from ._wire import check_token_ids
from .options import GenerateOptions, resolve_options

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
    messages: Sequence[Mapping[str, str]],
    options: GenerateOptions | None = None,
    **overrides: Unpack[GenerateOptionsDict],
) -> generation_pb2.GenerateRequest:
    """The request for ``chat``/``chat_stream``: ``messages`` is a sequence of
    ``{"role": ..., "content": ...}`` mappings; roles and template rules are the server's to check.
    Options as in ``build_generate_request``."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a sequence of {{'role': str, 'content': str}} mappings, "
                        f"got {type(messages).__name__}")
    req = resolve_options(options, overrides).to_pb()
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
