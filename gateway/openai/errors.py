"""The HTTP API's error surface: OpenAI-style bodies and the handlers that produce them.

Every failure leaves the gateway as ``{"error": {"message", "type", "param",
"code"}}``; the status and ``type`` come from the error's kind
(``kvmesh.services.contracts.errors.ErrorKind``), never from a table here. pydantic type errors
become INVALID_REQUEST (FastAPI would otherwise answer a 422 of its own shape),
and anything not raised on purpose is a bug: a logged 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.services.contracts.errors import (
    ErrorKind,
    InvalidRequestError,
    KvmeshError,
    reported_error,
)


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


def error_response(
    error: KvmeshError, status_code: int | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The HTTP answer for ``error``: its kind's status unless the framework chose one.

    Every OVERLOADED answer (429) says when to retry, as RFC 9110 suggests."""
    if error.kind is ErrorKind.OVERLOADED:
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
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


def _param_from_location(location: tuple[Any, ...], body: Any) -> str | None:
    """The path of the field at fault, as the client wrote it.

    pydantic's location also names the union member or discriminator value it
    tried ("str", "user"); walking the request body tells those apart from
    the client's own keys. The last part stays even when absent: a missing field.
    """
    parts = list(location)
    if parts and parts[0] == "body":  # FastAPI's prefix for body fields
        parts = parts[1:]
    named: list[str] = []
    node = body
    for position, part in enumerate(parts):
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif position < len(parts) - 1 or _is_union_tag(str(part)):
            continue  # pydantic's own label, not a field of the body
        named.append(str(part))
    return ".".join(named) if named else None


def invalid_request_from_validation(errors: Sequence[Any], body: Any = None) -> InvalidRequestError:
    """pydantic's complaints about a request body, as one error naming the first field."""
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    location = tuple(first.get("loc", ()))
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        # A discriminated union (messages by role, tools by type) names the tag field.
        location = (*location, str(first.get("ctx", {}).get("discriminator", "")).strip("'"))
    param = _param_from_location(location, body)
    message = str(first.get("msg", "invalid value"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return InvalidRequestError(message, param)


def install_exception_handlers(app: FastAPI) -> None:
    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):
            return error_response(invalid_request_from_validation(exc.errors(), exc.body))
        return response_for_exception(exc)

    async def on_kvmesh_error(_: Request, exc: Exception) -> JSONResponse:
        return response_for_exception(exc)

    async def on_http_exception(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, StarletteHTTPException):
            return response_for_exception(exc)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        kind = ErrorKind.from_http_status(exc.status_code)
        # The framework's headers stay (405's Allow lists the methods the path takes).
        return error_response(KvmeshError.of_kind(kind, message), exc.status_code, exc.headers)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(KvmeshError, on_kvmesh_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    # Anything else is caught by app.py's internal-error middleware: an
    # Exception handler here would answer and then re-raise.
