"""Bounded at the edge: calls in flight (429 at once), body bytes (413), prompts per call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.gateway.admission import AdmissionGate
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.grpc.servicer import GenerationServicer
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.services.runtime.config import GatewayConfig
from kvmesh.services.runtime.grpc_server import GrpcService
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

BODY = {"prompt": "Once upon a time", "max_tokens": 4}


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_a_call_past_the_bound_gets_429_before_reaching_the_engine(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    gate = AdmissionGate(1)
    app = build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), admission=gate)
    engine.hang_after_deltas = 1
    async with _client(app) as http:
        holding = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
        await engine.hanging.wait()
        refused = await http.post("/v1/completions", json=BODY)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert len(engine.requests) == 1  # the refused call never reached the engine
        assert (await http.get("/health")).status_code == 200  # other routes are not gated
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        assert gate.in_use == 0  # the slot is back
        engine.hang_after_deltas = None
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
    assert gate.refused == 1


async def test_a_body_over_the_limit_is_413_with_an_openai_error(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    limits = GatewayLimits(max_request_body_bytes=2048)
    app = build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), limits=limits)
    big = {**BODY, "prompt": "word " * 1000}

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * 512

    async with _client(app) as http:
        for response in (
            await http.post("/v1/completions", json=big),
            await http.post("/v1/completions", content=chunked()),
        ):
            assert response.status_code == 413
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "request_too_large"
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
    assert len(engine.requests) == 1


async def test_too_many_prompts_in_one_call_is_400(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    limits = GatewayLimits(max_prompts_per_request=2)
    app = build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), limits=limits)
    async with _client(app) as http:
        response = await http.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
        ok = await http.post("/v1/completions", json={**BODY, "prompt": ["a", "b"]})
        assert ok.status_code == 200
    assert len(engine.requests) == 2


async def test_the_served_schema_states_the_prompt_bound_the_gateway_enforces(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    config = GatewayConfig(max_prompts_per_request=2)
    limits = GatewayLimits.from_config(config)
    app = build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), limits=limits)
    async with _client(app) as http:
        schema = (await http.get("/openapi.json")).json()["components"]["schemas"]
        prompt = schema["CompletionRequest"]["properties"]["prompt"]["anyOf"]
        batches = [alternative for alternative in prompt if "maxItems" in alternative]
        # The list of strings and the list of token-id lists; a single list of
        # token ids is one prompt, bounded by the context length instead.
        assert [b["items"].get("type") for b in batches] == ["string", "array"]
        assert {b["maxItems"] for b in batches} == {2}
        assert "x-kvmesh-limit" not in str(schema)
        for prompts in (["a", "b", "c"], [[1, 2], [3], [4]]):
            refused = await http.post("/v1/completions", json={**BODY, "prompt": prompts})
            assert refused.status_code == 400
            assert "at most 2 prompts" in refused.json()["error"]["message"]
        one_long = await http.post("/v1/completions", json={**BODY, "prompt": [5, 6, 7, 8]})
        assert one_long.status_code == 200


async def test_public_grpc_is_bounded_too(engine: FakeEngineClient, tokenizer: Tokenizer) -> None:
    service = GrpcService("gateway", ["kvmesh.v1.Generation"], max_receive_message_bytes=4096)
    gate = AdmissionGate(1)
    servicer = GenerationServicer(
        engine, tokenizer, "m", GatewayMetrics.for_registry(CollectorRegistry()), admission=gate
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, service.server)
    port = await service.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await stub.Tokenize(generation_pb2.TokenizeRequest(text="x" * 10_000))
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            engine.hang_after_deltas = 1
            request = generation_pb2.GenerateRequest(text="Once upon a time")
            holding = stub.Generate(request)
            await holding.read()  # admitted and generating
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request):
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            holding.cancel()
    finally:
        await service.stop(grace=0)
