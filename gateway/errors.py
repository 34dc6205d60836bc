"""The HTTP API's error surface: OpenAI-style bodies and the handlers that produce them.

Every failure leaves the gateway as ``{"error": {"message", "type", "param",
"code"}}``; the status and ``type`` come from the error's kind
(``services.errors.ErrorKind``), never from a table here. pydantic type errors
become INVALID_REQUEST (FastAPI would otherwise answer a 422 of its own shape),
and anything not raised on purpose is a bug: a logged 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.errors import ErrorKind, InvalidRequestError, KvmeshError, reported_error


def error_body(error: KvmeshError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.kind.openai_type,
            "param": error.param,
            "code": error.code,
        }
    }


# Seconds an overloaded server asks a client to wait before retrying (429's Retry-After).
RETRY_AFTER_S = 1


def error_response(error: KvmeshError, status_code: int | None = None) -> JSONResponse:
    """The HTTP answer for ``error``: its kind's status unless the framework chose one.

    Every OVERLOADED answer (429) says when to retry, as RFC 9110 suggests."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.kind is ErrorKind.OVERLOADED else None
    return JSONResponse(
        error_body(error), status_code=status_code or error.kind.http_status, headers=headers
    )


def response_for_exception(exc: BaseException, where: str = "the HTTP API") -> JSONResponse:
    """The one exception -> HTTP response conversion of the API (bugs become a logged 500)."""
    return error_response(reported_error(exc, where))


_UNION_TAG_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member it tried ("str", "list[int]",
    # "TextContentPart", "function-after[...]"); that means nothing to a client.
    return part in _UNION_TAG_NAMES or "[" in part or "-" in part or part[:1].isupper()


def _param_from_location(location: tuple[Any, ...]) -> str | None:
    parts = [str(part) for part in location]
    if parts and parts[0] == "body":  # FastAPI's prefix for body fields
        parts = parts[1:]
    named = [part for part in parts if part and not _is_union_tag(part)]
    return ".".join(named) if named else None


def invalid_request_from_validation(errors: Sequence[Any]) -> InvalidRequestError:
    """pydantic's complaints about a request body, as one error naming the first field."""
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    param = _param_from_location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return InvalidRequestError(message, param)


def install_exception_handlers(app: FastAPI) -> None:
    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):
            return error_response(invalid_request_from_validation(exc.errors()))
        return response_for_exception(exc)

    async def on_kvmesh_error(_: Request, exc: Exception) -> JSONResponse:
        return response_for_exception(exc)

    async def on_http_exception(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, StarletteHTTPException):
            return response_for_exception(exc)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        kind = ErrorKind.from_http_status(exc.status_code)
        return error_response(KvmeshError.of_kind(kind, message), exc.status_code)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(KvmeshError, on_kvmesh_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    # Anything else is caught by app.py's internal-error middleware: an
    # Exception handler here would answer and then re-raise.
