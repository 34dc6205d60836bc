"""The public gRPC API in process: parameters map like HTTP's, the API key is enforced."""

from __future__ import annotations

import grpc
import pytest

from gateway.grpc_public import GenerationServicer, completion_request_from_proto
from gateway.metrics import GatewayMetrics
from protos import generation_pb2, generation_pb2_grpc
from services.grpc_server import GrpcService


def test_request_mapping_matches_the_http_fields() -> None:
    msg = generation_pb2.GenerateRequest(
        text="hi",
        priority=-3,
        cache_salt="tenant",
        sampling=generation_pb2.SamplingParameters(
            n=2,
            max_tokens=7,
            temperature=0.5,
            seed=11,
            stop=["x"],
            echo=True,
            user="u",
            regex="[ab]+",
            logit_bias={5: 1.5},
        ),
    )
    request = completion_request_from_proto(msg)
    assert (request.prompt, request.n, request.max_tokens, request.seed) == ("hi", 2, 7, 11)
    assert request.priority == -3 and request.cache_salt == "tenant" and request.echo
    assert request.stop == ["x"] and request.user == "u"
    assert request.structured_outputs is not None
    assert request.structured_outputs.model_dump(exclude_none=True) == {"regex": "[ab]+"}
    assert request.logit_bias == {"5": 1.5}


async def test_api_key_is_required_on_every_call(engine, tokenizer, registry) -> None:
    service = GrpcService("gateway", ["kvmesh.v1.Generation"])
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(
            engine, tokenizer, "m", GatewayMetrics.for_registry(registry), api_key="secret"
        ),
        service.server,
    )
    port = await service.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await _check_calls(generation_pb2_grpc.GenerationStub(channel), tokenizer)
    finally:
        await service.stop(grace=0)


async def _check_calls(stub, tokenizer) -> None:
    request = generation_pb2.TokenizeRequest(text="Hello world")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.Tokenize(request)
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as wrong:
        await stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), metadata=(("authorization", "Bearer nope"),)
        )
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = await stub.Tokenize(request, metadata=(("authorization", "Bearer secret"),))
    assert list(ok.token_ids) == tokenizer.encode("Hello world")
