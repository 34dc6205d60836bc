"""The /v1/responses routes and how /openapi.json documents them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.protocol import ErrorResponse
from gateway.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from gateway.responses.serving import ResponsesServing

ServeUntilDisconnect = Callable[[Request, Awaitable[Response]], Awaitable[Response]]

_NOT_STORED = {"model": ErrorResponse, "description": "No response with this id is stored"}

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

    @app.post("/v1/responses", response_model=None, responses={200: _CREATED, **errors})
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serve_until_disconnect(raw_request, serving.create_response(request))

    @app.get(
        "/v1/responses/{response_id}",
        response_model=ResponseObject,
        responses={**lookup_errors, 404: _NOT_STORED},
    )
    async def get_response(response_id: str) -> Response:
        return await serving.get_response(response_id)

    @app.delete("/v1/responses/{response_id}", responses={**lookup_errors, 404: _NOT_STORED})
    async def delete_response(response_id: str) -> DeletedResponse:
        return await serving.delete_response(response_id)
