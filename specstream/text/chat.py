"""Chat messages -> prompt text, with the model's own chat template in a sandboxed Jinja environment.

Contract: ``ChatTemplate(source, bos_token=..., eos_token=...)`` compiles a template once (a bad
template fails at load, naming the problem); ``render(messages, add_generation_prompt=True)``
returns the prompt text, exactly as transformers' ``apply_chat_template(..., tokenize=False)`` does
(same environment: ``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a non-escaping ``tojson``).
A template that raises for the given messages (e.g. "roles must alternate") gives ``ChatError``
with the template's own message. ``end_of_turn`` is the text the template closes an assistant turn
with (e.g. ``<|im_end|>``), found by rendering a probe conversation, so generation can stop there.
``renders_tools``: the template writes a request's tools and earlier calls itself, in the
``<tool_call>`` format (``render(..., tools=...)``).

The sandbox: templates come with model files, so they are treated as untrusted code. The
immutable sandbox refuses attribute access to Python internals and mutation of the passed-in
objects, and any error a template raises becomes ``ChatError``. Rendering is synchronous; its
input is bounded by the gateway's message-size and message-count limits, not by a time limit.

What it does not know: tokenization (the caller encodes the text, adding no BOS the template did
not write) or which roles a model accepts (the template decides; it may raise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["ChatError", "ChatTemplate"]


class ChatError(ValueError):
    """Messages the template cannot render (its own raise_exception), or a broken template."""


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which no chat format wants.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# A probe turn whose closing text is what generation should stop at.
_PROBE = "\u2063probe\u2063"


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        import jinja2
        import jinja2.meta

        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.end_of_turn = self._find_end_of_turn()
        # Whether it writes a request's tools itself, in the tool-call format this server holds
        # answers to (specstream/text/tools.py: Hermes' <tool_call> blocks, as Qwen2.5's does): it
        # reads a ``tools`` variable and writes the call tag. Otherwise the tools are described in
        # the system message by the server's default text.
        variables = jinja2.meta.find_undeclared_variables(_environment().parse(source))
        self.renders_tools = "tools" in variables and "<tool_call>" in source

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """``tools`` (OpenAI's ``tools`` entries) only for a template that ``renders_tools``; an
        assistant message's ``tool_calls`` then as OpenAI's, with ``arguments`` as objects."""
        import jinja2

        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}), **self._special)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - whatever a template does wrong is about these messages
            raise ChatError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from exc

    def _find_end_of_turn(self) -> str | None:
        """The text right after an assistant message's content, up to the next whitespace/newline."""
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                               add_generation_prompt=False)
        except ChatError:
            return None
        at = text.find(_PROBE)
        if at < 0:
            return None
        tail = text[at + len(_PROBE):]
        end = tail.split()[0] if tail.strip() else ""
        return end or None
