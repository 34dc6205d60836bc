"""The /v1/responses routes and how /openapi.json documents them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound, compile_path
from starlette.types import Receive, Scope, Send

from kvmesh.gateway.openai.protocol import ErrorResponse
from kvmesh.gateway.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from kvmesh.gateway.responses.serving import ResponsesServing

ServeUntilDisconnect = Callable[[Request, Awaitable[Response]], Awaitable[Response]]

_NOT_STORED = {"model": ErrorResponse, "description": "No response with this id is stored"}
_STORE_UNAVAILABLE = {
    "model": ErrorResponse,
    "description": "The response store (a kvstore) is not reachable",
}

# A streamed response: OpenAI's typed events, each an ``event:`` line and a ``data:`` line.
_CREATED = {
    "model": ResponseObject,
    "description": "The response, or with stream true its events as server-sent events",
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "event": {
                        "type": "string",
                        "description": "The event type (response.created, "
                        "response.output_text.delta, ..., response.completed)",
                    },
                    "data": {
                        "type": "string",
                        "description": "The event as JSON, with type and sequence_number",
                    },
                },
            }
        }
    },
}


_BY_ID = "/v1/responses/{response_id}"
# The stored response's id, for a client (and schemathesis' stateful phase)
# going from POST to GET or DELETE.
_LINKS = {
    f"{verb.capitalize()}Response": {
        "operationId": f"{verb}Response",
        "parameters": {"response_id": "$response.body#/id"},
    }
    for verb in ("get", "delete")
}


class _MethodNotAllowed(BaseRoute):
    """A 405 whose Allow names every method of a path served by several routes.

    Starlette answers a wrong method with the first route that matched the
    path, so it would name only that route's method.
    """

    def __init__(self, path: str, methods: set[str]) -> None:
        self._path_regex = compile_path(path)[0]
        self._allow = ", ".join(sorted(methods))
        self._methods = methods

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (
            scope["type"] == "http"
            and scope["method"] not in self._methods
            and self._path_regex.match(scope["path"])
        ):
            return Match.FULL, {}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise HTTPException(405, headers={"Allow": self._allow})


def add_responses_routes(
    app: FastAPI,
    serving: ResponsesServing,
    generation_errors: dict[int | str, dict[str, Any]],
    lookup_errors: dict[int | str, dict[str, Any]],
    serve_until_disconnect: ServeUntilDisconnect,
) -> None:
    """POST (a generation: ``generation_errors``), GET and DELETE by id (``lookup_errors``)."""

    errors = {
        **generation_errors,
        404: {
            "model": ErrorResponse,
            "description": "The model named is not the one served, or previous_response_id "
            "is not stored",
        },
    }

    app.router.routes.append(_MethodNotAllowed(_BY_ID, {"GET", "DELETE"}))

    @app.post(
        "/v1/responses",
        operation_id="createResponse",
        response_model=None,
        responses={200: {**_CREATED, "links": _LINKS}, **errors},
    )
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serve_until_disconnect(raw_request, serving.create_response(request))

    @app.get(
        _BY_ID,
        operation_id="getResponse",
        response_model=ResponseObject,
        responses={**lookup_errors, 404: _NOT_STORED, 503: _STORE_UNAVAILABLE},
    )
    async def get_response(response_id: str) -> Response:
        return await serving.get_response(response_id)

    @app.delete(
        _BY_ID,
        operation_id="deleteResponse",
        responses={**lookup_errors, 404: _NOT_STORED, 503: _STORE_UNAVAILABLE},
    )
    async def delete_response(response_id: str) -> DeletedResponse:
        return await serving.delete_response(response_id)
