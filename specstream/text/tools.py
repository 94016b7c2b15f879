"""Tool calling as text: how the tools a request offers are written into the conversation, the
grammar that holds the answer to the tool-call format, and the parser that reads the calls back.

The format (the default for a model whose chat template has no tool support, as SmolLM2's; a
template that writes this format itself, as Qwen2.5's, is handed the tools instead:
``ChatTemplate.renders_tools``, gateway/tools.py):
the tools are listed in the system message, one JSON object a line inside ``<tools></tools>``,
and the model calls one by writing a JSON object with its ``name`` and ``arguments`` inside
``<tool_call>`` tags, each tag on its own line, as Hermes-style and Qwen2.5 models are trained to::

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

A call the assistant made earlier in the conversation is written back the same way, so a model
sees its own calls as it wrote them; a tool's result goes in as a ``tool`` message.

``tool_constraint(tools, choice, parallel)`` is the Lark grammar (llguidance's, with the
arguments' JSON schemas inline, compact JSON as every constrained answer here) that the output
must match:
- ``"required"`` or one function's name: one call (``parallel``: one or more, a line apart) and
  nothing else, so a call's opening text up to its first free choice is forced;
- ``"auto"``: free text, and wherever ``<tool_call>`` starts, a call that must be well formed;
- ``"none"``: free text in which ``<tool_call>`` never appears.
Each call's ``name`` is one of the offered tools' and its ``arguments`` match that tool's schema.

``ToolCallParser`` reads the output as it streams: ``feed(text)`` returns the content that can be
shown (text that may still become a call's opening tag is held back) and the calls completed;
``finish()`` the rest.

Plain data and text: no torch, no protocol buffers.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from specstream.data.constraint import Constraint

__all__ = ["CALL_CLOSE", "CALL_OPEN", "TOOL_CHOICES", "Tool", "ToolCall", "ToolCallParser", "render_calls",
           "tool_constraint", "tools_system_text"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")  # or the name of one function
# No JSON whitespace, as every constrained JSON answer here (specstream/text/grammar.py's JSON_OPTIONS).
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: str = '{"type":"object","properties":{}}'  # the JSON schema's text, its key order kept

    def spec(self) -> dict:
        """As OpenAI's ``tools`` entries have it (what the system message lists)."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)


def tools_system_text(tools: list[Tool]) -> str:
    """The text that tells the model which tools it has and how to call them."""
    listed = "\n".join(json.dumps(tool.spec(), ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
            "Their signatures are within <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} tags:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{CALL_CLOSE}')


def render_calls(calls: list[ToolCall]) -> str:
    """An assistant's earlier calls, as it writes them."""
    return "\n".join(f"{CALL_OPEN}\n{_call_json(c.name, c.arguments)}\n{CALL_CLOSE}" for c in calls)


def _call_json(name: str, arguments: str) -> str:
    try:  # compact, as the grammar makes the model write it
        arguments = json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        pass  # written back as the client sent it
    return f'{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":{arguments}}}'


def tool_constraint(tools: list[Tool], choice: str, parallel: bool = True) -> Constraint:
    """The grammar the output must match; ``choice``: one of TOOL_CHOICES or a tool's name."""
    if choice == "none":
        return Constraint("grammar", f"start: TEXT\n{_text_without_calls()}")
    offered = tools if choice in ("auto", "required") else [t for t in tools if t.name == choice]
    if not offered:
        raise ValueError(f"tool_choice {choice!r} names no offered tool")
    schema = {"anyOf": [_call_schema(t) for t in offered], "x-guidance": _COMPACT}
    body = f'"\\n" %json {json.dumps(schema, ensure_ascii=False)} "\\n{CALL_CLOSE}"'
    if choice == "auto":
        calls = "(call_head call_body)*" if parallel else "(call_head call_body)?"
        return Constraint("grammar", f"start: {calls} TEXT\n"
                                     f'call_head[lazy]: ANY "{CALL_OPEN}"\n'
                                     f"call_body: {body}\n"
                                     f"ANY: /(?s:.*)/\n{_text_without_calls()}")
    more = ' ("\\n" call)*' if parallel and choice == "required" else ""
    return Constraint("grammar", f'start: call{more}\ncall: "{CALL_OPEN}" {body}\n')


def _text_without_calls() -> str:
    return f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/\n"


def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": json.loads(tool.parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


class ToolCallParser:
    """Reads a streamed answer: content and completed calls, in the order they were written."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet given out: a possible opening tag, or a call's inside
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """More output -> (content to show, calls completed by it)."""
        self._pending += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    break
                calls.append(self._call(self._pending[:end]))
                self._pending = self._pending[end + len(CALL_CLOSE):].removeprefix("\n")
                self._in_call = False
                continue
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                keep = _partial_tag(self._pending)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content.append(self._pending[:start].removesuffix("\n"))  # the tag's own line
            self._pending = self._pending[start + len(CALL_OPEN):]
            self._in_call = True
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> str:
        """The text held back at the end: a partial tag, or an unfinished call's text as written
        (an answer cut by its token budget)."""
        rest = (CALL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest

    @staticmethod
    def _call(inside: str) -> ToolCall:
        """A call's JSON (the grammar made it well formed; a free answer may not be: its text is
        kept as the arguments, and the name is empty)."""
        try:
            value = json.loads(inside)
            name, arguments = value["name"], value["arguments"]
            return ToolCall(str(name), json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
                            ToolCall.new_id())
        except (ValueError, KeyError, TypeError):
            return ToolCall("", inside.strip(), ToolCall.new_id())


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>`` (on its own line)."""
    for n in range(min(len(text), len(CALL_OPEN)), 0, -1):
        if ("\n" + CALL_OPEN).startswith(text[-n:]) or CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
