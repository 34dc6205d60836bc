"""The public gRPC API in process: parameters map like HTTP's, the API key is enforced."""

from __future__ import annotations

import grpc
import pydantic
import pytest

from kvmesh.gateway.engine_params.validation import render_chat
from kvmesh.gateway.grpc.servicer import (
    GenerationServicer,
    chat_prompt_ids,
    completion_request_from_proto,
)
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.protocol import ChatMessage
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.runtime.grpc_server import GrpcService


def test_request_mapping_matches_the_http_fields() -> None:
    msg = generation_pb2.GenerateRequest(
        text="hi",
        priority=-3,
        cache_salt="tenant",
        sampling=generation_pb2.SamplingParameters(
            n=2,
            max_tokens=7,
            temperature=0.5,
            top_n_sigma=1.25,
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
    assert request.top_n_sigma == 1.25


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


def _chat_request(*messages: tuple[str, str], **fields) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(**fields)
    msg.messages.messages.extend(
        generation_pb2.ChatMessage(role=role, content=content) for role, content in messages
    )
    return msg


def test_messages_render_with_the_models_template_as_http_chat_does(tokenizer) -> None:
    conversation = [("system", "Be brief."), ("user", "What is 2+2?")]
    ids = chat_prompt_ids(_chat_request(*conversation), tokenizer)
    messages = pydantic.TypeAdapter(list[ChatMessage]).validate_python(
        [{"role": role, "content": content} for role, content in conversation]
    )
    as_http = render_chat(messages, tokenizer)
    assert ids == tokenizer.encode(as_http, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\n")
    # Without the generation prompt, and continuing the last message instead.
    bare = chat_prompt_ids(_chat_request(*conversation, add_generation_prompt=False), tokenizer)
    assert ids[: len(bare)] == bare and len(bare) < len(ids)
    continued = chat_prompt_ids(
        _chat_request(
            ("user", "Hi"),
            ("assistant", "Hello the"),
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        tokenizer,
    )
    assert tokenizer.decode(continued, skip_special_tokens=False).endswith("Hello the")
    request = completion_request_from_proto(_chat_request(*conversation), ids)
    assert request.prompt == ids


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (_chat_request(), "messages must not be empty"),
        (_chat_request(("wizard", "hi")), "role"),
        (
            _chat_request(("user", "hi"), continue_final_message=True),
            "continue_final_message and add_generation_prompt",
        ),
    ],
)
def test_bad_messages_are_invalid_requests(tokenizer, msg, expected) -> None:
    with pytest.raises(InvalidRequestError, match=expected) as info:
        chat_prompt_ids(msg, tokenizer)
    assert info.value.param in ("messages", "continue_final_message") or "role" in str(info.value)


async def test_generate_with_messages_submits_the_rendered_prompt(
    engine, tokenizer, registry
) -> None:
    service = GrpcService("gateway", ["kvmesh.v1.Generation"])
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, tokenizer, "m", GatewayMetrics.for_registry(registry)),
        service.server,
    )
    port = await service.start("127.0.0.1", 0)
    msg = _chat_request(
        ("user", "What is 2+2?"), sampling=generation_pb2.SamplingParameters(max_tokens=3)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            responses = [r async for r in stub.Generate(msg)]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Generate(_chat_request(("robot", "hi"))):
                    pass
    finally:
        await service.stop(grace=0)
    (submitted,) = engine.requests
    assert submitted.prompt_token_ids == chat_prompt_ids(msg, tokenizer)
    assert responses[-1].finish_reason == "length"
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
