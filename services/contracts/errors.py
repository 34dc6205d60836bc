"""The one error taxonomy: every kind of failure and what each surface reports for it.

A service raises a ``KvmeshError`` subclass to say *what* went wrong; its
``ErrorKind`` row says how every surface reports it, and each surface converts
exactly once:

- every gRPC server (inter-service and the public API): the interceptor in
  ``kvmesh.services.runtime.grpc_server`` aborts with ``kind.grpc_code``;
- every gRPC client of another kvmesh service: ``error_from_rpc`` reads the
  status back into the same kind;
- the HTTP API: ``kvmesh.gateway.openai.errors`` answers ``kind.http_status`` with an OpenAI
  error body whose ``type`` is ``kind.openai_type``.

Any other exception (TypeError, KeyError, a library's ValueError...) is a bug,
not the caller's fault: ``reported_error`` logs it with its traceback and
reports INTERNAL (HTTP 500), never a 4xx. Code that refuses input raises
``InvalidRequestError`` explicitly.
"""

from __future__ import annotations

import enum
import logging
from typing import ClassVar

import grpc

logger = logging.getLogger(__name__)


class ErrorKind(enum.Enum):
    """One row per kind of failure: (gRPC status, HTTP status, OpenAI error type)."""

    INVALID_REQUEST = (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
    UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404, "not_found_error")
    OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
    INTERNAL = (grpc.StatusCode.INTERNAL, 500, "internal_error")
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error")
    DEADLINE = (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error")

    def __init__(self, grpc_code: grpc.StatusCode, http_status: int, openai_type: str) -> None:
        self.grpc_code = grpc_code
        self.http_status = http_status
        self.openai_type = openai_type

    @classmethod
    def from_grpc_code(cls, code: grpc.StatusCode) -> ErrorKind:
        """The kind a peer reported. A code no kind claims (CANCELLED, UNKNOWN...)
        means the peer could not serve the call without saying why: UNAVAILABLE,
        which tells the caller it may retry."""
        for kind in cls:
            if kind.grpc_code == code:
                return kind
        return cls.UNAVAILABLE

    @classmethod
    def from_http_status(cls, status: int) -> ErrorKind:
        """The kind for a status the web framework chose itself (unknown route 404,
        wrong method 405): the row with that status, else by class of status."""
        for kind in cls:
            if kind.http_status == status:
                return kind
        return cls.INVALID_REQUEST if status < 500 else cls.INTERNAL


_ERROR_CLASS_OF_KIND: dict[ErrorKind, type[KvmeshError]] = {}


class KvmeshError(Exception):
    """An error raised on purpose; the subclass's ``kind`` decides every surface's status.

    Raise a subclass (one per kind, below), never this base, which has no kind.

    ``param`` names the request field at fault and ``code`` is a machine-readable
    reason (both end up in the OpenAI error body).
    """

    kind: ClassVar[ErrorKind]

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __init_subclass__(cls) -> None:
        # The class that declares a kind is the one every conversion builds, so
        # ``except UnavailableError`` also catches an UNAVAILABLE read off the wire.
        super().__init_subclass__()
        if "kind" not in cls.__dict__:
            return
        if cls.kind in _ERROR_CLASS_OF_KIND:
            raise TypeError(f"{cls.__name__}: {cls.kind} already has an error class")
        _ERROR_CLASS_OF_KIND[cls.kind] = cls

    @staticmethod
    def of_kind(kind: ErrorKind, message: str) -> KvmeshError:
        """An error of ``kind``, as the class callers catch for that kind."""
        return _ERROR_CLASS_OF_KIND[kind](message)

    @property
    def details(self) -> str:
        """The message with the field at fault, for surfaces without a ``param`` slot."""
        return f"{self.message} (param {self.param})" if self.param else self.message


class InvalidRequestError(KvmeshError):
    """The caller sent something the service cannot accept."""

    kind = ErrorKind.INVALID_REQUEST


class UnauthenticatedError(KvmeshError):
    """The call lacks the API key the server requires."""

    kind = ErrorKind.UNAUTHENTICATED


class NotFoundError(KvmeshError):
    """The caller named something (a model) that this server does not have."""

    kind = ErrorKind.NOT_FOUND


class OverloadedError(KvmeshError):
    """A bounded queue is full; the caller should retry later."""

    kind = ErrorKind.OVERLOADED


class InternalError(KvmeshError):
    """A bug: the service failed in a way that is not the caller's doing."""

    kind = ErrorKind.INTERNAL


class UnavailableError(KvmeshError):
    """A dependency is down (e.g. no worker); the caller may retry."""

    kind = ErrorKind.UNAVAILABLE


class DeadlineExceededError(KvmeshError):
    """The call did not complete in the time it was given."""

    kind = ErrorKind.DEADLINE


def reported_error(exc: BaseException, where: str) -> KvmeshError:
    """``exc`` as the error a surface reports: itself when raised on purpose,
    else an INTERNAL error, after logging the bug's traceback (never sent on)."""
    if isinstance(exc, KvmeshError):
        return exc
    logger.error("unexpected error in %s", where, exc_info=exc)
    return InternalError("internal server error")


def error_from_rpc(error: grpc.aio.AioRpcError) -> KvmeshError:
    """What a failed call to another kvmesh service reports, read back through the table."""
    return KvmeshError.of_kind(
        ErrorKind.from_grpc_code(error.code()), error.details() or error.code().name
    )
