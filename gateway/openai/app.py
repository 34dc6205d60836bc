"""The gateway's FastAPI application: OpenAI-compatible routes plus health, metrics, tokenizer.

``build_app`` wires an ``EngineClient`` (gRPC in production, a fake in tests)
to the HTTP routes. The app never touches tensors or KV blocks; everything it
knows about the engine comes through the client.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.gateway.admission import POOLING_PATHS, AdmissionGate, AdmissionMiddleware
from kvmesh.gateway.engine.client import EngineClient
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.served_models import ServedModels
from kvmesh.gateway.engine_params.validation import check_token_ids, render_chat
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.body_limit import BodyLimitMiddleware
from kvmesh.gateway.openai.errors import (
    error_response,
    install_exception_handlers,
    response_for_exception,
)
from kvmesh.gateway.openai.lora_routes import add_lora_routes
from kvmesh.gateway.openai.openapi_schema import build_openapi
from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.openai.pooling_routes import add_pooling_routes
from kvmesh.gateway.openai.protocol import (
    BATCH_INVARIANT_COST,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvmesh.gateway.openai.serving_chat import ChatServing
from kvmesh.gateway.openai.serving_common import ServingContext
from kvmesh.gateway.openai.serving_completions import CompletionServing
from kvmesh.gateway.openai.serving_pooling import PoolingServing
from kvmesh.gateway.responses.routes import add_responses_routes
from kvmesh.gateway.responses.serving import ResponsesServing
from kvmesh.gateway.responses.store import MemoryResponseStore, ResponseStore
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tracing import HttpTracingMiddleware
from kvmesh.services.contracts.errors import (
    KvmeshError,
    UnauthenticatedError,
    UnavailableError,
)
from kvmesh.services.runtime.tracing import Tracing

logger = logging.getLogger(__name__)

# /ready answers 503 rather than hang when the engine does not answer in time.
READY_TIMEOUT_S = 5.0
# Status logged (never seen by anyone) when a client leaves before its answer.
_CLIENT_CLOSED_REQUEST = 499
_PROTECTED_PREFIXES = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    *(path for path in POOLING_PATHS if not path.startswith("/v1/")),
)


def _package_version() -> str:
    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


class _InternalErrorMiddleware:
    """Answer any exception that escaped a route with its OpenAI body (a bug: a logged 500).

    Starlette's own catch-all re-raises after answering; this one keeps the
    failure inside the gateway, and stays silent toward a client whose
    response has already started (a stream), which only gets cut short.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking_start(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking_start)
        except Exception as exc:
            response = response_for_exception(exc, f"{scope.get('method')} {scope['path']}")
            if not started:
                await response(scope, receive, send)


class _ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on the OpenAI routes (/v1/...).

    Health, readiness, metrics and version stay open for probes and scrapers.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            headers = dict(scope.get("headers") or [])
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                refusal = UnauthenticatedError("invalid or missing API key", code="invalid_api_key")
                response = error_response(refusal)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _serve_until_disconnect(raw_request: Request, handler: Awaitable[Response]) -> Response:
    """Run a generation handler, cancelling it (and so aborting its engine
    requests) if the client disconnects before it answers."""
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not handler_task.done():
            handler_task.cancel()
        await asyncio.gather(disconnect_task, handler_task, return_exceptions=True)
    if handler_task.cancelled():
        logger.info("client disconnected before the response; request cancelled")
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    error = handler_task.exception()
    if error is not None:
        return response_for_exception(error)
    return handler_task.result()


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_MODEL_NOT_FOUND = _error("The model named is not the one served")
_OVERLOADED = _error("Too many requests are waiting; retry later")
_UNAVAILABLE = _error("The engine is not available")


def _documented_errors(requires_api_key: bool) -> dict[int | str, dict[str, Any]]:
    errors: dict[int | str, dict[str, Any]] = {400: _error("The request is invalid")}
    if requires_api_key:
        errors[401] = _error("Missing or wrong API key")
    return errors


def _only_auth(errors: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """The errors of a route without a body: only a missing API key."""
    return {status: error for status, error in errors.items() if status == 401}


def _generated(model: type[BaseModel]) -> dict[str, Any]:
    """A generation's 200: the whole response as JSON, or server-sent events when streamed."""
    return {
        "model": model,
        "description": "The response, or with stream true its chunks as server-sent events",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {
                            "type": "string",
                            "description": "A chunk as JSON, an error body, or [DONE] last",
                        }
                    },
                }
            }
        },
    }


def build_app(
    engine: EngineClient,
    tokenizer: Tokenizer,
    served_model_name: str,
    metrics_registry: CollectorRegistry | None = None,
    api_key: str | None = None,
    limits: GatewayLimits | None = None,
    admission: AdmissionGate | None = None,
    serve_metrics: bool = True,
    tracing: Tracing | None = None,
    models: ServedModels | None = None,
    output_parsing: OutputParsing | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The HTTP app; with ``api_key``, /v1 and tokenizer routes require it as a bearer token.

    ``admission`` bounds the generation calls in flight (shared with the public
    gRPC API); without it, the engine's own 429 is the only bound.
    ``serve_metrics``: False when /metrics lives on a port of its own (or nowhere).
    With ``tracing``, each /v1 call is a server span (gateway/tracing.py). ``models``:
    the LoRA adapters served besides ``served_model_name`` (none by default).
    ``output_parsing``: the reasoning and tool-call parsers of chat completions and
    responses (none by default, and tool_choice "auto" refused).
    ``response_store``: where /v1/responses keeps responses (this process's memory
    with the config's bounds by default).
    """
    limits = limits or GatewayLimits()
    models = models or ServedModels(served_model_name)
    app = FastAPI(title="kvmesh gateway", version=_package_version())
    install_exception_handlers(app)
    schema: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        # Built on first use: the engine's model facts are known only once it started.
        if not schema:
            schema.update(
                build_openapi(
                    app, served_model_name, engine.model_info, tokenizer.vocab_size, limits
                )
            )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    errors = _documented_errors(api_key is not None and api_key != "")
    # Each add wraps the ones before, so they run in reverse: a refused key
    # never reaches the gate, and a call the gate refuses has no body read.
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if admission is not None:
        app.add_middleware(AdmissionMiddleware, gate=admission)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    if tracing is not None:
        # Outermost: the span also covers (and records) refusals.
        app.add_middleware(HttpTracingMiddleware, tracing=tracing)
    registry = REGISTRY if metrics_registry is None else metrics_registry
    metrics = GatewayMetrics.for_registry(registry)
    context = ServingContext(engine, tokenizer, served_model_name, metrics, limits, models, tracing)
    completions = CompletionServing(context)
    chat = ChatServing(context, output_parsing)
    responses = ResponsesServing(context, response_store or MemoryResponseStore(), output_parsing)

    generation_errors = {**errors, 404: _MODEL_NOT_FOUND, 429: _OVERLOADED, 503: _UNAVAILABLE}

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: _generated(CompletionResponse), **generation_errors},
    )
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _serve_until_disconnect(raw_request, completions.create_completion(request))

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: _generated(ChatCompletionResponse), **generation_errors},
    )
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await _serve_until_disconnect(raw_request, chat.create_chat_completion(request))

    add_responses_routes(
        app, responses, generation_errors, _only_auth(errors), _serve_until_disconnect
    )

    @app.get("/v1/models", responses=_only_auth(errors))
    async def list_models() -> ModelList:
        info = engine.model_info
        max_model_len = info.max_model_len
        cards = [
            ModelCard(
                id=served_model_name,
                max_model_len=max_model_len,
                dtype=info.dtype or None,
                dtype_reason=info.dtype_reason or None,
                quantization=info.quantization or None,
                weight_bytes=info.weight_bytes,
                batch_invariant=info.batch_invariant or None,
                batch_invariant_cost=BATCH_INVARIANT_COST if info.batch_invariant else None,
            )
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=served_model_name,
                max_model_len=max_model_len,
            )
            for lora in models.adapters.values()
        ]
        return ModelList(data=cards)

    if models.lora_enabled:
        add_lora_routes(app, models, errors)

    pooling = PoolingServing(context)
    add_pooling_routes(app, pooling, generation_errors, _serve_until_disconnect)

    @app.get("/health")
    async def health() -> HealthResponse:
        # Liveness only: the process answers. Readiness is /ready.
        return HealthResponse()

    @app.get("/ready", response_model=ReadyResponse, responses={503: _UNAVAILABLE})
    async def ready() -> Response:
        try:
            await asyncio.wait_for(engine.check_ready(), timeout=READY_TIMEOUT_S)
        except KvmeshError as exc:
            return error_response(UnavailableError(f"engine not ready: {exc.message}"))
        except TimeoutError:
            return error_response(UnavailableError("engine not ready: readiness check timed out"))
        return JSONResponse(ReadyResponse().model_dump())

    if serve_metrics:

        @app.get(
            "/metrics",
            response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format"}},
        )
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_package_version())

    def tokenize_in_thread(request: TokenizeRequest) -> TokenizeResponse:
        if isinstance(request, TokenizeCompletionRequest):
            text = request.prompt
        else:
            text = render_chat(request.messages, tokenizer, request.add_generation_prompt)
        token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            count=len(token_ids),
            max_model_len=engine.model_info.max_model_len,
            tokens=token_ids,
            token_strs=(
                [tokenizer.id_to_token(t) or "" for t in token_ids]
                if request.return_token_strs
                else None
            ),
        )

    @app.post(
        "/tokenize",
        response_model_exclude_none=True,
        responses={**errors, 404: _MODEL_NOT_FOUND},
    )
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        models.resolve(request.model)
        return await tokenizer.offload(tokenize_in_thread, request)

    @app.post("/detokenize", responses={**errors, 404: _MODEL_NOT_FOUND})
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        models.resolve(request.model)
        check_token_ids(request.tokens, tokenizer.vocab_size, "tokens")
        return DetokenizeResponse(prompt=await tokenizer.offload(tokenizer.decode, request.tokens))

    return app
