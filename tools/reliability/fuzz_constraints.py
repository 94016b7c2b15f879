"""Random constraints and tools for the fuzzer (tools/reliability/fuzz.py): JSON schemas of random
shapes (objects, arrays, strings with lengths and patterns, numbers with bounds, enums, consts,
anyOf, nesting), regular expressions and Lark grammars put together from valid and broken
pieces, choice lists, and OpenAI tool lists with random names, schemas and tool_choice. About a
third of each are broken on purpose (a misspelt type, an unclosed group, an undefined rule, an
empty choice, a tool name with a space); the rest may still be refused by the grammar compiler.
The oracle for all of them: served, or refused as invalid naming the constraint's field (gRPC) /
a 400 (HTTP), never a crash.
"""

from __future__ import annotations

import json
import random
import string

__all__ = ["random_constraint", "random_schema", "random_tools_body"]

_REGEX_PIECES = ["a", "b", "[a-z]", "[0-9]", "\\d", "(ab|cd)", "x{2,5}", "[A-Z]+", "-", " ", "\\.", "(yes|no)", "é",
                 "[^\\n]", "z?"]
_BROKEN_REGEX = ["(", ")", "[", "*", "+*", "\\", "{3", "[z-a]", "(?<=a)b", "a{5,2}"]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + "_") for _ in range(rng.randint(1, 10)))


def random_schema(rng: random.Random, depth: int = 0, broken: bool = False) -> dict:
    """A JSON schema of a random shape (``broken``: with one wrong keyword value somewhere)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "null"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if broken and rng.random() < 0.5:
        return rng.choice([{"type": rng.choice(["strin", "int", "objekt", 5])},
                           {"type": "string", "pattern": rng.choice(_BROKEN_REGEX)},
                           {"type": "object", "properties": rng.choice([[1, 2], "x"])},
                           {"$ref": "#/$defs/" + _name(rng)},
                           {"type": "array", "items": rng.choice([5, "x"])},
                           {"enum": rng.choice([[], "x"])}])
    if kind == "object":
        names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(0, 4))))
        schema = {"type": "object", "properties": {n: random_schema(rng, depth + 1, broken) for n in names}}
        if names and rng.random() < 0.7:
            schema["required"] = rng.sample(names, rng.randint(1, len(names)))
        if rng.random() < 0.5:
            schema["additionalProperties"] = False
        return schema
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1, broken)}
        if rng.random() < 0.5:
            low = rng.randint(0, 3)
            schema |= {"minItems": low, "maxItems": low + rng.randint(0, 3)}
        return schema
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1, broken) for _ in range(rng.randint(1, 3))]}
    if kind == "string":
        schema: dict = {"type": "string"}
        if rng.random() < 0.5:
            schema["maxLength"] = rng.randint(0, 30)
        if rng.random() < 0.3:
            schema["pattern"] = "^" + "".join(rng.choice(_REGEX_PIECES) for _ in range(rng.randint(1, 4))) + "$"
        return schema
    if kind in ("integer", "number"):
        schema = {"type": kind}
        if rng.random() < 0.5:
            low = rng.randint(-1000, 1000)
            schema |= {"minimum": low, "maximum": low + rng.randint(0, 1000)}
        return schema
    if kind == "enum":
        return {"enum": [rng.choice([_name(rng), rng.randint(-5, 5), None, True]) for _ in range(rng.randint(1, 5))]}
    if kind == "const":
        return {"const": _name(rng)}
    return {"type": kind}


def _regex(rng: random.Random, broken: bool) -> str:
    pieces = [rng.choice(_REGEX_PIECES) for _ in range(rng.randint(1, 6))]
    if broken:
        pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(_BROKEN_REGEX))
    return "".join(pieces)


def _grammar(rng: random.Random, broken: bool) -> str:
    rules = [f"r{i}" for i in range(rng.randint(1, 4))]
    lines = ["start: " + " | ".join(rng.sample(rules, rng.randint(1, len(rules))))]
    for rule in rules:
        parts = [rng.choice([json.dumps(_name(rng)), "/" + _regex(rng, False) + "/", rng.choice(rules)])
                 for _ in range(rng.randint(1, 3))]
        lines.append(f"{rule}: {' '.join(parts)}")
    if broken:
        lines.append(rng.choice(["start: undefined_rule", "r0: (", "r1 \"x\"", "%json {", ": x"]))
    return "\n".join(lines)


def random_constraint(rng: random.Random) -> tuple[str, object]:
    """(the kind of GenerateRequest.constraint, its value): json_schema (JSON text, sometimes not
    JSON at all), regex, grammar or choice (a list of strings)."""
    kind = rng.choice(["json_schema", "json_schema", "regex", "grammar", "choice"])
    broken = rng.random() < 0.35
    if kind == "json_schema":
        if broken and rng.random() < 0.2:
            return kind, rng.choice(["{", "[1, 2]", "not json", '"a string"'])
        return kind, json.dumps(random_schema(rng, broken=broken))
    if kind == "regex":
        return kind, _regex(rng, broken)
    if kind == "grammar":
        return kind, _grammar(rng, broken)
    choices = [_name(rng) for _ in range(rng.randint(1, 6))]
    if broken:
        choices.append("")
    return kind, choices


def random_tools_body(rng: random.Random) -> dict:
    """The tool fields of a chat body: tools (random names and schemas, some broken), tool_choice
    and parallel_tool_calls."""
    tools = []
    for _ in range(rng.randint(0, 4)):
        broken = rng.random() < 0.2
        name = _name(rng) + (rng.choice([" x", "!", "." * 70]) if broken and rng.random() < 0.5 else "")
        parameters = random_schema(rng, depth=1, broken=broken)
        tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
            "arg": parameters}, "required": ["arg"]}}}
        if rng.random() < 0.3:
            tool["function"]["description"] = _name(rng)
        tools.append(tool)
    body: dict = {"tools": tools} if tools or rng.random() < 0.5 else {}
    choice = rng.choice([None, "none", "auto", "required", "named", "missing", "bogus"])
    if choice == "named" and tools:
        body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
    elif choice == "missing":
        body["tool_choice"] = {"type": "function", "function": {"name": _name(rng) + "_x"}}
    elif choice == "bogus":
        body["tool_choice"] = rng.choice(["sometimes", 5, {"type": "code"}])
    elif choice not in (None, "named"):
        body["tool_choice"] = choice
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = rng.random() < 0.5
    return body
