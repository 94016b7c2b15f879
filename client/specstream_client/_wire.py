"""Checks that a Python value can be carried by a protobuf field, before any RPC.

Contract: each check takes the field's name (for the message) and the caller's value and returns
the value the field will carry, or raises ``TypeError`` (wrong type) or ``ValueError`` (a value the
field cannot encode, quoted in the message). Ints include numpy-style integers (anything with
``__index__``) but never ``bool``.

What it does not know: what a field means or which values the server accepts -- only what the
wire can encode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "UINT32_MAX",
    "UINT64_MAX",
    "check_bool",
    "check_float",
    "check_int",
    "check_str",
    "check_token_ids",
]

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def check_int(name: str, value: Any, lo: int, hi: int, kind: str) -> int:
    """An int the wire can carry in ``lo..hi`` (``kind`` names the field type, e.g. "int32")."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    iv = int(value.__index__())
    if not lo <= iv <= hi:
        raise ValueError(f"{name} must fit in {kind} ({lo}..{hi}), got {iv}")
    return iv


def check_float(name: str, value: Any) -> float:
    # NaN, inf and out-of-range values are sent as given: the server names them.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")
    return value


def check_token_ids(name: str, values: Any) -> list[int]:
    """A sequence of token ids (each a uint32)."""
    if isinstance(values, str | bytes | bytearray) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out: list[int] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
        iv = int(v.__index__())
        if not 0 <= iv <= UINT32_MAX:
            raise ValueError(f"{name}[{i}] must be a token id in 0..{UINT32_MAX}, got {iv}")
        out.append(iv)
    return out
