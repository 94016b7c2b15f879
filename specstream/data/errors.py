"""Errors a caller can cause or meet, each tied to the gRPC status code it travels as.

Core code raises these; one server interceptor (`specstream.serving.grpc_server.ErrorInterceptor`) turns
them into statuses, so handlers never pick codes themselves. Messages name the field and value.
An error that arrives as a status (another service's, e.g. on a target's sequence event) is rebuilt
as its class by `from_status`.
"""

from __future__ import annotations

from typing import Any

import grpc


class SpecstreamError(Exception):
    """Base class; `code` is the gRPC status the error is reported as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgumentError(SpecstreamError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={_short(value)}: {reason}")


class AlreadyExistsError(SpecstreamError):
    """A request id that is already in use where it must be unique."""

    code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={_short(value)}: {reason}")


class InternalError(SpecstreamError):
    """A bug or a failed computation on our side; the caller did nothing wrong."""

    code = grpc.StatusCode.INTERNAL


class OverloadedError(SpecstreamError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(SpecstreamError):
    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(SpecstreamError):
    """No credentials the server can read: no token, or not a bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(SpecstreamError):
    """Credentials were presented and refused: a wrong token, or a peer not on the allow-list."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RemoteError(SpecstreamError):
    """An error another service attached to one sequence, passed on with its code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


def status_code(number: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)


# The class each status code is raised as: every class above but the base and RemoteError.
_CLASS_OF: dict[grpc.StatusCode, type[SpecstreamError]] = {
    cls.code: cls for cls in (InvalidArgumentError, AlreadyExistsError, InternalError, OverloadedError,
                              UnavailableError, UnauthenticatedError, PermissionDeniedError)}


def error_class(code: grpc.StatusCode) -> type[SpecstreamError]:
    """The class of the errors reported as `code`; RemoteError for a code no class here is tied to."""
    return _CLASS_OF.get(code, RemoteError)


def from_status(code: grpc.StatusCode, message: str) -> SpecstreamError:
    """An error another service reported as a status (`code`, `message`), rebuilt as an instance of
    `error_class(code)`, so that it is reported on with the same code and caught as that class;
    its text is `message` as sent.

    Only the code and the text cross the wire, not the values that made the text: a rebuilt
    InvalidArgumentError or AlreadyExistsError has `field` and `value` None (its message still
    names them) and, for the former, the whole message as `reason`."""
    cls = error_class(code)
    if cls is RemoteError:
        return RemoteError(code, message)
    error = cls.__new__(cls)  # not cls(...): those two classes build their message from the values
    Exception.__init__(error, message)
    if isinstance(error, InvalidArgumentError | AlreadyExistsError):
        error.field = error.value = None
    if isinstance(error, InvalidArgumentError):
        error.reason = message
    return error
