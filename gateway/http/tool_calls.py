"""OpenAI's tool calling on the HTTP front, as translation only: a chat body's ``tools``,
``tool_choice``, ``parallel_tool_calls`` and an assistant's earlier ``tool_calls`` put into the
public request's fields (refusing by name what cannot even be put there: a tool that is not a
function, a name or arguments that are not strings, a schema that is not an object), and the
answer's calls given back as OpenAI has them. Every other rule (names, schemas, the choice, the
conversation's text, the grammar, reading the answer) is the gateway's, for both fronts
(gateway/tools.py).

What it does not know: how the model is run; HTTP status codes.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.http.schema import ChatCompletionRequest
from specstream.data.errors import InvalidArgumentError
from specstream_pb import generation_pb2

__all__ = ["call_out", "earlier_call", "param_name", "set_tools"]


def set_tools(req: generation_pb2.GenerateRequest, body: ChatCompletionRequest) -> None:
    """The body's tools, tool_choice and parallel_tool_calls on the request."""
    for i, entry in enumerate(body.tools or []):  # their count and every rule: gateway/tools.py
        at = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise InvalidArgumentError(f"{at}.type", entry.get("type") if isinstance(entry, dict) else entry,
                                       "must be 'function'")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise InvalidArgumentError(f"{at}.function", function, "must be an object with name and parameters")
        name, description, schema = function.get("name"), function.get("description") or "", function.get("parameters")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"{at}.function.name", name, "must be 1..64 letters, digits, _ or -")
        if not isinstance(description, str):
            raise InvalidArgumentError(f"{at}.function.description", description, "must be a string")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidArgumentError(f"{at}.function.parameters", schema, "must be a JSON schema (an object)")
        req.tools.add(name=name, description=description,
                      parameters=json.dumps(schema, ensure_ascii=False) if schema is not None else "")
    choice = body.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        choice = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, str):
            raise InvalidArgumentError("tool_choice", body.tool_choice, "must be 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
    elif choice is not None and not isinstance(choice, str):
        raise InvalidArgumentError("tool_choice", choice, "must be 'none', 'auto', 'required' or a function")
    if choice is not None:
        req.tool_choice = choice
    if body.parallel_tool_calls is not None:
        req.parallel_tool_calls = body.parallel_tool_calls


def earlier_call(at: str, call: Any) -> generation_pb2.ToolCall:
    """An assistant's earlier call ({"id", "type": "function", "function": {"name", "arguments"}})."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgumentError(f"{at}.function", function, "must be an object with name and arguments")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidArgumentError(f"{at}.function.arguments", arguments, "must be a JSON object's text")
    return generation_pb2.ToolCall(id=str(call.get("id", "")), name=function["name"], arguments=arguments)


def param_name(field: str, body: ChatCompletionRequest) -> str | None:
    """The OpenAI parameter behind a tool field that validation named (None: not a tool field):
    a tool's name, description and parameters sit under its ``function``, as do an earlier
    call's; a named tool_choice is its ``function.name``."""
    head = field.split("[", 1)[0].split(".", 1)[0]
    at, _, rest = field.rpartition(".")
    if head == "tools" and at.count(".") == 0 and rest in ("name", "description", "parameters"):
        return f"{at}.function.{rest}"  # tools[3].parameters -> tools[3].function.parameters
    if head == "messages" and at.endswith("]") and ".tool_calls[" in at and rest in ("name", "arguments"):
        return f"{at}.function.{rest}"
    if field == "tool_choice":
        return "tool_choice.function.name" if isinstance(body.tool_choice, dict) else "tool_choice"
    return None


def call_out(call: generation_pb2.ToolCall) -> dict[str, Any]:
    """A call as OpenAI returns it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
