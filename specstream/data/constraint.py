"""What a request's output must match: a JSON schema, any JSON object, a regular expression, a Lark
grammar, or one of a few strings (``Constraint``), checked once when built.

The grammar library compiles it against the model's tokenizer (specstream/text/grammar.py); here
only what needs no tokenizer is checked: a known kind, a source within ``MAX_SOURCE_BYTES``, a
schema that is a JSON object, choices that are 1..``MAX_CHOICES`` non-empty strings. The field
names are the public request's (``constraint.json_schema``, ...). Plain data: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specstream.data.errors import InvalidArgumentError
from specstream_pb import common_pb2

__all__ = ["CONSTRAINT_KINDS", "MAX_CHOICES", "MAX_SOURCE_BYTES", "Constraint"]

# json_object: any JSON object, its source empty; choice: a JSON array of the strings allowed.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# A costly input bounded before it reaches a compiler: 64 KiB holds the schemas of real tool sets
# (OpenAI's own limit on a function's parameters is smaller), and a grammar's size past it is
# refused as written rather than compiled.
MAX_SOURCE_BYTES = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of CONSTRAINT_KINDS
    source: str = ""  # the schema's JSON text, the regex, the Lark grammar, or the choices' JSON array

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidArgumentError("constraint", self.kind, f"must be one of {', '.join(CONSTRAINT_KINDS)}")
        field = self.field
        size = len(self.source.encode())
        if size > MAX_SOURCE_BYTES:
            raise InvalidArgumentError(field, f"<{size} bytes>", f"must be at most {MAX_SOURCE_BYTES} bytes")
        if self.kind == "json_object":
            if self.source:
                raise InvalidArgumentError(field, self.source, "takes no source")
            return
        if not self.source:
            raise InvalidArgumentError(field, self.source, "must not be empty")
        if self.kind == "json_schema":
            if not isinstance(_json(field, self.source), dict):
                raise InvalidArgumentError(field, self.source, "must be a JSON object (a JSON schema)")
        elif self.kind == "choice":
            _ = self.choices  # parsed and checked

    @classmethod
    def from_pb(cls, pb: common_pb2.Constraint) -> Constraint | None:
        """The wire form (every hop's), None when no kind is set; checks itself as built."""
        kind = pb.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not pb.json_object:
                raise InvalidArgumentError("constraint.json_object", False, "set it true, or leave the constraint out")
            return cls("json_object")
        if kind == "choice":
            return cls("choice", json.dumps(list(pb.choice.choices)))
        return cls(kind, getattr(pb, kind))

    def to_pb(self) -> common_pb2.Constraint:
        if self.kind == "json_object":
            return common_pb2.Constraint(json_object=True)
        if self.kind == "choice":
            return common_pb2.Constraint(choice=common_pb2.Choices(choices=self.choices))
        return common_pb2.Constraint(**{self.kind: self.source})

    @property
    def field(self) -> str:
        """The public request's name for the source."""
        return f"constraint.{self.kind}"

    @property
    def choices(self) -> list[str]:
        """A choice constraint's strings, in order."""
        value = _json(self.field, self.source)
        if not (isinstance(value, list) and 1 <= len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)):
            raise InvalidArgumentError(self.field, self.source,
                                       f"must be a JSON array of 1..{MAX_CHOICES} non-empty strings")
        return value


def _json(field: str, source: str) -> object:
    try:
        return json.loads(source)
    except json.JSONDecodeError as err:
        raise InvalidArgumentError(field, source, f"is not JSON: {err}") from None
