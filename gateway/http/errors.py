"""Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status OpenAI uses, chosen here and only here for every route and for errors inside a stream.

The status follows the gRPC code the same exception travels as on the gRPC front
(specstream/data/errors.py), so both fronts classify a failure alike: INVALID_ARGUMENT -> 400 (with
`param` the OpenAI parameter), UNAUTHENTICATED -> 401 (with `WWW-Authenticate: Bearer`, RFC 6750),
PERMISSION_DENIED -> 403, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429 and UNAVAILABLE -> 503 (both
with `Retry-After`), anything unexpected -> 500.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import grpc

from specstream.data.errors import InvalidArgumentError, SpecstreamError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # overload and not-ready refusals: the queue drains / a replica comes back in about this long

# gRPC code -> (HTTP status, OpenAI error type, OpenAI error code)
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}
_INTERNAL = (500, "server_error", "internal_error")


@dataclass
class ApiError(Exception):
    """An error ready to send: status, OpenAI's body fields, and headers."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist; this server serves '{served}' (GET /v1/models)",
                    "invalid_request_error", "model", "model_not_found")


def from_exception(exc: BaseException, param_of=lambda field: field) -> ApiError:
    """`exc` as OpenAI would report it. `param_of` maps a validation field to the caller's
    parameter name; a bad parameter's message names that parameter and its value."""
    if isinstance(exc, ApiError):
        return exc
    # A target's InvalidArgumentError arrives as its text only (field None): reported as the status below.
    if isinstance(exc, InvalidArgumentError) and exc.field is not None:
        param = param_of(exc.field)
        shown = exc.value if isinstance(exc.value, str) and exc.value.startswith("<") else repr(exc.value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return bad_request(f"{param}={shown}: {exc.reason}", param)
    if isinstance(exc, SpecstreamError):
        status, kind, code = _BY_CODE.get(exc.code, _INTERNAL)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else \
            {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        return ApiError(status, str(exc), kind, None, code, headers)
    log.exception("unexpected error in the HTTP front", exc_info=exc)
    status, kind, code = _INTERNAL
    return ApiError(status, f"{type(exc).__name__}: {exc}", kind, None, code)


def from_validation(errors: list[dict[str, Any]]) -> ApiError:
    """A body pydantic could not read (pydantic's error list, first error reported): malformed
    JSON, a missing required field, or a value of the wrong JSON type."""
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "no body"}
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           None, "invalid_json")
    param = _param_of_loc(first.get("loc", ()))
    if first.get("type") == "missing":
        return bad_request(f"{param or 'the body'}: a required field is missing", param, "missing_required_parameter")
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    if param is None:  # the body itself: JSON but not an object, or not sent as JSON
        return bad_request(f"the request body must be a JSON object (Content-Type: application/json), got {shown}",
                           None, "invalid_body")
    return bad_request(f"{param}={shown}: {first.get('msg', 'invalid')}", param)


# The members of a union in pydantic's error locations ("str", "list[int]", "int", ...), not fields.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z]+\[.*\]|[a-z-]+\(.*\))$")


def _param_of_loc(loc) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"; stops at a union member's tag."""
    parts: list[str | int] = []
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(part, str) and _TYPE_TAG.match(part):
            break
        parts.append(part)
    text = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))
    return text or None
