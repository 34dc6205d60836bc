"""One error table, read the same on every surface.

``CONTRACT`` is a literal copy of ``kvmesh.services.contracts.errors.ErrorKind`` on purpose:
changing a row, or a surface that converts through a mapping of its own, fails
here. Each kind is raised inside (a) an inter-service gRPC server and read
back by the gateway's engine client, (b) the HTTP API, (c) the public gRPC
API; a bug (TypeError, KeyError, a stray ValueError) must come out as
INTERNAL / 500 with its traceback logged, never as a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.gateway.engine.client import GenerationRequest
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.gateway.grpc.servicer import GenerationServicer
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.protos import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvmesh.services.contracts.errors import ErrorKind, KvmeshError
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams
from kvmesh.services.runtime.grpc_server import GrpcService
from tests.gateway.fakes import FakeEngineClient

CONTRACT = {
    ErrorKind.INVALID_REQUEST: (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    ErrorKind.NOT_FOUND: (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    ErrorKind.OVERLOADED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL, 500, "internal_error"),
    ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    ErrorKind.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
}
KINDS = list(CONTRACT)


# Programming errors, not refusals: a stray ValueError is as much a bug as a TypeError.
BUGS = [TypeError, KeyError, ValueError]


def test_the_table_is_the_contract() -> None:
    table = {kind: (kind.grpc_code, kind.http_status, kind.openai_type) for kind in ErrorKind}
    assert table == CONTRACT


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_each_kind_has_one_error_class(kind: ErrorKind) -> None:
    error = KvmeshError.of_kind(kind, "m")
    assert error.kind is kind and type(error).kind is kind
    assert ErrorKind.from_grpc_code(CONTRACT[kind][0]) is kind


def _assert_bug_logged(caplog: pytest.LogCaptureFixture, bug: Exception) -> None:
    """The bug's traceback reached the log at ERROR."""
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is bug]
    assert logged and logged[0].levelno == logging.ERROR


# ---- (a) inter-service gRPC, read back by the gateway's engine client -------


class _SchedulerRaising(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler whose AddRequest raises whatever the test sets."""

    def __init__(self) -> None:
        self.fail_with: Exception = RuntimeError("set by the test")

    async def GetInfo(self, request, context) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=[2]
        )

    async def AddRequest(self, request, context) -> scheduler_pb2.AddRequestResponse:
        raise self.fail_with


class _SilentDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    """Accepts the gateway's subscription and never sends anything."""

    async def StreamDetokenized(
        self, request, context
    ) -> AsyncIterator[detokenizer_pb2.DetokenizedBatch]:
        await context.send_initial_metadata(())
        nothing: asyncio.Queue[detokenizer_pb2.DetokenizedBatch] = asyncio.Queue()
        while True:
            yield await nothing.get()


@contextlib.asynccontextmanager
async def _engine_over_grpc() -> AsyncIterator[
    tuple[_SchedulerRaising, scheduler_pb2_grpc.SchedulerStub, GrpcEngineClient]
]:
    scheduler = _SchedulerRaising()
    service = GrpcService("scheduler+detokenizer", [])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, service.server)
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(_SilentDetokenizer(), service.server)
    port = await service.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    engine = GrpcEngineClient(address, address, token_text=str)
    try:
        await engine.start(timeout=10)
        async with grpc.aio.insecure_channel(address) as channel:
            yield scheduler, scheduler_pb2_grpc.SchedulerStub(channel), engine
    finally:
        await engine.close()
        await service.stop(grace=0)


async def _submit(engine: GrpcEngineClient) -> None:
    request = GenerationRequest(
        request_id="r",
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(),
        detokenize_params=DetokenizeParams(),
    )
    async for _ in engine.generate(request):
        pytest.fail("a refused request must not produce deltas")


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
async def test_inter_service_status_and_the_kind_read_back(kind: ErrorKind) -> None:
    async with _engine_over_grpc() as (scheduler, stub, engine):
        scheduler.fail_with = KvmeshError.of_kind(kind, f"{kind.name} on purpose")
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.AddRequest(scheduler_pb2.AddRequestRequest(request_id="raw"))
        assert raw.value.code() == CONTRACT[kind][0]
        assert raw.value.details() == f"{kind.name} on purpose"
        with pytest.raises(KvmeshError) as read_back:
            await _submit(engine)
        assert type(read_back.value) is type(scheduler.fail_with)
        assert read_back.value.message == f"{kind.name} on purpose"


@pytest.mark.parametrize("bug_class", BUGS)
async def test_inter_service_bug_is_internal_and_logged(
    bug_class: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    bug = bug_class("bug in the scheduler")
    async with _engine_over_grpc() as (scheduler, stub, engine):
        scheduler.fail_with = bug
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.AddRequest(scheduler_pb2.AddRequestRequest(request_id="raw"))
        assert raw.value.code() == grpc.StatusCode.INTERNAL
        assert "bug" not in raw.value.details()  # internals stay in the server's log
        with pytest.raises(KvmeshError) as read_back:
            await _submit(engine)
        assert read_back.value.kind is ErrorKind.INTERNAL
    _assert_bug_logged(caplog, bug)


# ---- (b) the HTTP API -------------------------------------------------------

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
async def test_http_status_and_openai_type(
    kind: ErrorKind, client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_with = KvmeshError.of_kind(kind, f"{kind.name} on purpose")
    response = await client.post("/v1/completions", json=COMPLETION)
    _, http_status, openai_type = CONTRACT[kind]
    assert response.status_code == http_status, response.text
    assert response.json() == {
        "error": {
            "message": f"{kind.name} on purpose",
            "type": openai_type,
            "param": None,
            "code": None,
        }
    }


@pytest.mark.parametrize("bug_class", BUGS)
async def test_http_bug_is_a_logged_500(
    bug_class: type[Exception],
    client: httpx.AsyncClient,
    engine: FakeEngineClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bug = engine.fail_with = bug_class("bug in the engine client")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error"
    assert "bug" not in response.text
    _assert_bug_logged(caplog, bug)


# ---- (c) the public gRPC API ------------------------------------------------


async def _public_generate_error(
    engine: FakeEngineClient, tokenizer: Tokenizer, registry: CollectorRegistry
) -> grpc.aio.AioRpcError:
    service = GrpcService("gateway", ["kvmesh.v1.Generation"])
    servicer = GenerationServicer(engine, tokenizer, "m", GatewayMetrics.for_registry(registry))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, service.server)
    port = await service.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stub.Generate(generation_pb2.GenerateRequest(text="hi")):
                    pytest.fail("a refused request must not produce responses")
            return raised.value
    finally:
        await service.stop(grace=0)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
async def test_public_grpc_status(
    kind: ErrorKind, engine: FakeEngineClient, tokenizer: Tokenizer, registry: CollectorRegistry
) -> None:
    engine.fail_with = KvmeshError.of_kind(kind, f"{kind.name} on purpose")
    error = await _public_generate_error(engine, tokenizer, registry)
    assert error.code() == CONTRACT[kind][0]
    assert error.details() == f"{kind.name} on purpose"


@pytest.mark.parametrize("bug_class", BUGS)
async def test_public_grpc_bug_is_internal_and_logged(
    bug_class: type[Exception],
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bug = engine.fail_with = bug_class("bug in the engine client")
    error = await _public_generate_error(engine, tokenizer, registry)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "bug" not in error.details()
    _assert_bug_logged(caplog, bug)
