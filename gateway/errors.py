"""OpenAI-style error bodies and the exception handlers that produce them.

Every failure leaves the gateway as ``{"error": {"message", "type", "param",
"code"}}`` with a meaningful status: 400 for bad input (including pydantic type
errors, which FastAPI would otherwise answer with a 422 of its own shape), 404
for an unknown model or route, 429/503 when the engine is overloaded or down,
and 500 only for a genuine bug, which is logged.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.engine_client import EngineError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class RequestError(Exception):
    """A client request the gateway refuses; carries the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.code = code


def error_body(
    message: str, status_code: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status_code, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    message: str, status_code: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code)


def response_for_exception(exc: BaseException) -> JSONResponse:
    """Map any exception raised while serving a request to its OpenAI error response."""
    if isinstance(exc, RequestError):
        return error_response(exc.message, exc.status_code, exc.param, exc.code)
    if isinstance(exc, EngineError):
        status = exc.status_code if exc.status_code in (400, 429, 503) else 503
        return error_response(exc.message, status)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return error_response("internal server error", 500)


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


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response("invalid request", 400)
    first = errors[0]
    param = _param_from_location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return error_response(message, 400, param)


def install_exception_handlers(app: FastAPI) -> None:
    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):
            return validation_error_response(exc)
        return response_for_exception(exc)

    async def on_request_or_engine_error(_: Request, exc: Exception) -> JSONResponse:
        return response_for_exception(exc)

    async def on_http_exception(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, StarletteHTTPException):
            return response_for_exception(exc)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(message, exc.status_code)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(RequestError, on_request_or_engine_error)
    app.add_exception_handler(EngineError, on_request_or_engine_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    # Anything else is caught by app.py's internal-error middleware: an
    # Exception handler here would answer and then re-raise.
