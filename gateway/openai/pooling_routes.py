"""The HTTP routes of the pooling APIs (handlers in gateway/openai/serving_pooling.py).

Each route runs its handler until the client disconnects (then its engine
requests are aborted), as the generation routes do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.responses import Response

from kvmesh.gateway.openai.protocol_pooling import (
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from kvmesh.gateway.openai.serving_pooling import PoolingServing

ServeUntilDisconnect = Callable[[Request, Awaitable[Response]], Awaitable[Response]]


async def _json(work: Awaitable[BaseModel]) -> Response:
    return JSONResponse((await work).model_dump(exclude_none=True))


def add_pooling_routes(
    app: FastAPI,
    serving: PoolingServing,
    errors: dict[int | str, dict[str, Any]],
    serve: ServeUntilDisconnect,
) -> None:
    @app.post(
        "/v1/embeddings",
        response_model=EmbeddingResponse,
        responses=errors,
    )
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await serve(raw_request, _json(serving.create_embedding(request)))

    @app.post("/pooling", response_model=PoolingResponse, responses=errors)
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await serve(raw_request, _json(serving.create_pooling(request)))

    @app.post("/score", response_model=ScoreResponse, responses=errors)
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await serve(raw_request, _json(serving.create_score(request)))

    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await serve(raw_request, _json(serving.create_rerank(request)))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(
            path, rerank, methods=["POST"], response_model=RerankResponse, responses=errors
        )

    @app.post("/classify", response_model=ClassifyResponse, responses=errors)
    async def create_classify(request: ClassifyRequest, raw_request: Request) -> Response:
        return await serve(raw_request, _json(serving.create_classify(request)))
