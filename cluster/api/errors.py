"""Typed errors, one per gRPC status a caller can act on.

Backends (the worker's service, the router's proxy) raise these; the gRPC servicer turns
them into statuses, the OpenAI HTTP front into HTTP codes, and the SDK turns statuses
back into them, so a caller sees the same exception whether it talked to a worker, the
router or an in-process backend.
"""

from __future__ import annotations

import grpc


class OrchardError(Exception):
    """Base class. `code` is the gRPC status; `http_status` what the OpenAI API answers."""

    code = grpc.StatusCode.UNKNOWN
    http_status = 500

    def __init__(self, message: str = "", code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.message else self.code.name


class InvalidRequest(OrchardError, ValueError):
    """Bad input (INVALID_ARGUMENT): the message says what to fix; `param`, when known,
    names the request field at fault (OpenAI's error `param`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, message: str = "", code: grpc.StatusCode | None = None, param: str | None = None):
        super().__init__(message, code)
        self.param = param


class BadField(InvalidRequest):
    """An InvalidRequest about one request field, which `param` names."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param=param)


class NotFound(OrchardError):
    """Unknown model (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AlreadyExists(OrchardError):
    """A request with this id is already running here (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class Overloaded(OrchardError):
    """The waiting queue is full (RESOURCE_EXHAUSTED): retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(OrchardError):
    """Draining, starting, stopping or unreachable (UNAVAILABLE): retry elsewhere.
    `retry_after`, when set, is when to ask again (seconds; HTTP's Retry-After)."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    retry_after: int | None = None


class DeadlineExceeded(OrchardError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Cancelled(OrchardError):
    code = grpc.StatusCode.CANCELLED
    http_status = 499


class InternalError(OrchardError):
    code = grpc.StatusCode.INTERNAL
    http_status = 500


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_status(code: grpc.StatusCode, message: str = "") -> OrchardError:
    cls = _BY_CODE.get(code, OrchardError)
    return cls(message, code=code)


def from_rpc_error(e: grpc.RpcError) -> OrchardError:
    """An OrchardError for a failed call (sync or asyncio grpc)."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    err = from_status(code or grpc.StatusCode.UNKNOWN, details or "")
    err.__cause__ = e
    return err
