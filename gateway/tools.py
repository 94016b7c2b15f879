"""Tool calling in a public request, for both fronts: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked (each error names the field and the value), the conversation
written with them, the grammar the answer must match, and the answer read back for its calls.

The format, the grammar and the parser are specstream/text/tools.py's; this module applies them
to a ``GenerateRequest`` (gateway/validation.py calls ``read_tools`` and ``conversation``) and to
the answer as it streams (gateway/request.py keeps a ``CallReader`` per request that reads calls).
The HTTP front only translates OpenAI's JSON into these fields and the calls back into its JSON
(gateway/http/tool_calls.py).

What it does not know: protocol buffers beyond the public request's fields, HTTP, the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

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
from specstream_pb import generation_pb2

__all__ = ["MAX_TOOLS", "CallReader", "ToolRequest", "conversation", "read_tools"]

MAX_TOOLS = 128  # OpenAI's own limit on a request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_ARGUMENTS = '{"type":"object","properties":{}}'  # a tool given without parameters


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked: what the model may call, how, and the grammar that holds it to that."""

    tools: list[Tool]
    choice: str  # one of TOOL_CHOICES or a tool's name
    parallel: bool

    @property
    def reads_calls(self) -> bool:
        """Whether the answer may hold calls (so it is read for them)."""
        return self.choice != "none"

    def constraint(self, given: Constraint | None) -> Constraint | None:
        """What the answer must match: the tool-call grammar; with tool_choice "none", a constraint
        the request gives instead (else text that never starts a call)."""
        if given is not None:
            if self.reads_calls:
                raise InvalidArgumentError("constraint", "<set>",
                                           "cannot be combined with tools unless tool_choice is 'none'")
            return given
        return tool_constraint(self.tools, self.choice, self.parallel)


def read_tools(req: generation_pb2.GenerateRequest) -> ToolRequest | None:
    """The request's tools, each checked; None where it offers none (then tool_choice may only be
    empty or "none", and parallel_tool_calls unset)."""
    if not req.tools:
        if req.tool_choice not in ("", "none"):
            raise InvalidArgumentError("tool_choice", req.tool_choice, "needs tools")
        return None
    if req.WhichOneof("input") != "messages":
        raise InvalidArgumentError("tools", f"<{len(req.tools)} tools>", "need a chat (messages), not a prompt")
    if len(req.tools) > MAX_TOOLS:
        raise InvalidArgumentError("tools", f"<{len(req.tools)} tools>", f"at most {MAX_TOOLS} allowed")
    tools, names = [], set()
    for i, tool in enumerate(req.tools):
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgumentError(f"tools[{i}].name", tool.name, "must be 1..64 letters, digits, _ or -")
        if tool.name in names:
            raise InvalidArgumentError(f"tools[{i}].name", tool.name, "is offered twice")
        names.add(tool.name)
        tools.append(Tool(tool.name, tool.description, _parameters(f"tools[{i}].parameters", tool.parameters)))
    choice = req.tool_choice or "auto"  # OpenAI's default where tools are offered
    if choice not in TOOL_CHOICES and choice not in names:
        raise InvalidArgumentError("tool_choice", choice,
                                   f"must be one of {list(TOOL_CHOICES)} or the name of a tool in tools")
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    return ToolRequest(tools, choice, parallel)


def _parameters(field: str, text: str) -> str:
    """A function's arguments' schema, refused (with the grammar compiler's reason) where it is not
    a JSON schema this server can hold the arguments to."""
    if not text:
        return NO_ARGUMENTS
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise InvalidArgumentError(field, f"<{len(text.encode())} bytes>", f"must be at most {MAX_SOURCE_BYTES} bytes")
    try:
        schema = json.loads(text)
    except ValueError as err:
        raise InvalidArgumentError(field, text, f"not JSON: {err}") from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(field, text, "must be a JSON schema (an object)")
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(text))
    except ValueError as err:
        error = str(err)
    if error:
        raise InvalidArgumentError(field, text, error)
    return text


def conversation(messages: list[generation_pb2.ChatMessage], tools: ToolRequest | None,
                 native: bool = False) -> tuple[list[dict], list[dict] | None]:
    """(the messages as the chat template reads them, the tools to hand it). ``native``: the
    template renders tools and calls itself (``ChatTemplate.renders_tools``): it gets the tools as
    OpenAI's entries and an assistant's earlier calls as OpenAI's ``tool_calls`` (arguments as
    objects). Otherwise the server's default: the tools' description joins the system message
    (one is put first where there is none) and earlier calls are written into the assistant's
    content as the model writes them. A tool's result is a ``tool`` message either way."""
    out = [_message(i, m, native) for i, m in enumerate(messages)]
    if tools is None:
        return out, None
    if native:
        return out, [tool.spec() for tool in tools.tools]
    text = tools_system_text(tools.tools)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def _message(i: int, message: generation_pb2.ChatMessage, native: bool) -> dict:
    if not message.tool_calls:
        return {"role": message.role, "content": message.content}
    if message.role != "assistant":
        raise InvalidArgumentError(f"messages[{i}].tool_calls", f"<{len(message.tool_calls)} calls>",
                                   "only an assistant message makes calls")
    calls = []
    for j, call in enumerate(message.tool_calls):
        if not call.name:
            raise InvalidArgumentError(f"messages[{i}].tool_calls[{j}].name", call.name, "must not be empty")
        calls.append(ToolCall(call.name, call.arguments or "{}", call.id))
    if native:
        written = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                   for c in calls]
        return {"role": "assistant", "content": message.content, "tool_calls": written}
    written = render_calls(calls)
    return {"role": "assistant", "content": f"{message.content}\n{written}" if message.content else written}


def _arguments(call: ToolCall) -> object:
    """An earlier call's arguments as templates read them (an object; its text where it is not JSON)."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


class CallReader:
    """One answer read for its calls as it streams: ``feed`` gives the content outside the calls
    and the calls completed (each with a fresh id)."""

    def __init__(self) -> None:
        self._parser = ToolCallParser()

    def feed(self, text: str, final: bool) -> tuple[str, list[generation_pb2.ToolCall]]:
        content, calls = self._parser.feed(text)
        if final:
            content += self._parser.finish()
        return content, [generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]

    @property
    def called(self) -> bool:
        return bool(self._parser.calls)
