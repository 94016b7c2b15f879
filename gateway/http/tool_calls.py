"""OpenAI's tool calling on the HTTP front: a chat body's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked (each error names the parameter and the value), the conversation
written with them (the tool-call format of specstream/text/tools.py), the grammar the answer must
match, and the answer's calls as OpenAI returns them (``message.tool_calls``, or in a stream a
``delta.tool_calls`` entry per call when its closing tag arrives; ``finish_reason: "tool_calls"``).

What it does not know: how the model is run; HTTP status codes.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from gateway.http.schema import ChatCompletionRequest, ChatMessage
from specstream.data.constraint import MAX_SOURCE_BYTES, Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.text.tools import (
    TOOL_CHOICES,
    Tool,
    ToolCall,
    ToolCallParser,
    render_calls,
    tool_constraint,
    tools_system_text,
)

__all__ = ["MAX_TOOLS", "ToolAnswer", "calls_tools", "conversation", "grammar", "offered", "tool_choice"]

MAX_TOOLS = 128  # OpenAI's own limit on a request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def offered(body: ChatCompletionRequest) -> list[Tool]:
    """The body's tools, each checked; [] without any."""
    raw = body.tools or []
    if len(raw) > MAX_TOOLS:
        raise InvalidArgumentError("tools", f"<{len(raw)} tools>", f"at most {MAX_TOOLS} allowed")
    tools, names = [], set()
    for i, entry in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise InvalidArgumentError(f"{at}.type", entry.get("type") if isinstance(entry, dict) else entry,
                                       "must be 'function'")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise InvalidArgumentError(f"{at}.function", function, "must be an object with name and parameters")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgumentError(f"{at}.function.name", name, "must be 1..64 letters, digits, _ or -")
        if name in names:
            raise InvalidArgumentError(f"{at}.function.name", name, "is offered twice")
        names.add(name)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise InvalidArgumentError(f"{at}.function.description", description, "must be a string")
        tools.append(Tool(name, description, _parameters(f"{at}.function.parameters", function.get("parameters"))))
    return tools


def _parameters(field: str, schema: Any) -> str:
    """A function's arguments' schema as JSON text, refused (with the grammar compiler's reason)
    where it is not a JSON schema this server can hold the arguments to."""
    if schema is None:  # OpenAI allows it out: a function that takes no arguments
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise InvalidArgumentError(field, schema, "must be a JSON schema (an object)")
    text = json.dumps(schema, ensure_ascii=False)
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise InvalidArgumentError(field, f"<{len(text.encode())} bytes>", f"must be at most {MAX_SOURCE_BYTES} bytes")
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(text))
    except ValueError as err:
        error = str(err)
    if error:
        raise InvalidArgumentError(field, schema, error)
    return text


def tool_choice(body: ChatCompletionRequest, tools: list[Tool]) -> str:
    """"none", "auto", "required" or the name of the one function to call. Left out: "auto"
    where tools are offered, as OpenAI."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidArgumentError("tool_choice", choice,
                                       "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
        if name not in {t.name for t in tools}:
            raise InvalidArgumentError("tool_choice.function.name", name, "names no tool in tools")
        return name
    if choice not in TOOL_CHOICES:
        raise InvalidArgumentError("tool_choice", choice, f"must be one of {list(TOOL_CHOICES)} or a function")
    if choice != "none" and not tools:
        raise InvalidArgumentError("tool_choice", choice, "needs tools")
    return choice


def grammar(body: ChatCompletionRequest, tools: list[Tool], choice: str) -> Constraint:
    """The grammar the answer must match with these (checked) tools and choice: "none" leaves it
    free, but for the call format."""
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return tool_constraint(tools, choice, parallel)


def calls_tools(body: ChatCompletionRequest) -> bool:
    """Whether the answer of a body (already checked) is read for calls: tools with a tool_choice
    other than "none"."""
    return bool(body.tools) and body.tool_choice != "none"


def conversation(body: ChatCompletionRequest, tools: list[Tool]) -> list[tuple[str, str]]:
    """The messages as (role, content) for the chat template: the (checked) tools' description
    joins the system message (one is put first where there is none), an assistant's earlier calls
    are written as it writes them, a tool's result is a ``tool`` message."""
    out = [(m.role, _content(i, m)) for i, m in enumerate(body.messages)]
    if tools:
        text = tools_system_text(tools)
        if out and out[0][0] in ("system", "developer"):
            out[0] = (out[0][0], f"{out[0][1]}\n\n{text}" if out[0][1] else text)
        else:
            out.insert(0, ("system", text))
    return out


def _content(i: int, message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise InvalidArgumentError(f"messages[{i}].content[{j}].type", part.type, "only text parts are supported")
        content = "".join(part.text for part in content)
    content = content or ""
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidArgumentError(f"messages[{i}].tool_calls", "<set>", "only an assistant message makes calls")
        calls = render_calls([_earlier_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(message.tool_calls)])
        content = f"{content}\n{calls}" if content else calls
    return content


def _earlier_call(at: str, call: Any) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgumentError(f"{at}.function", function, "must be an object with name and arguments")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidArgumentError(f"{at}.function.arguments", arguments, "must be a JSON object's text")
    return ToolCall(function["name"], arguments, str(call.get("id", "")))


class ToolAnswer:
    """One answer read for its calls, unary or as it streams."""

    def __init__(self) -> None:
        self.parser = ToolCallParser()

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer's message: content (null where only calls were written) and tool_calls."""
        content, _ = self.parser.feed(text)
        content += self.parser.finish()
        if not self.parser.calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content.strip() or None,
                "tool_calls": [_call_out(c) for c in self.parser.calls]}

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """A streamed piece -> (content to send, tool_calls delta entries); ``final``: the last."""
        content, calls = self.parser.feed(text)
        if final:
            content += self.parser.finish()
        first = len(self.parser.calls) - len(calls)
        return content, [{"index": first + k, **_call_out(c)} for k, c in enumerate(calls)]

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" where the answer ended on its own after making calls."""
        return "tool_calls" if reason == "stop" and self.parser.calls else reason


def _call_out(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
