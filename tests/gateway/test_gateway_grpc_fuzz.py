"""No input makes the public gRPC API fail as a server bug: arbitrary Generate requests
get a stream or a client-error status, never INTERNAL or UNKNOWN (issue 14)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.gateway.grpc.servicer import GenerationServicer
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.services.runtime.grpc_server import GrpcService
from tests.gateway.fakes import FakeEngineClient

_SERVER_BUGS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
# Scalars by proto type, reaching every edge of the wire type.
_BY_TYPE = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_FLOAT: _FLOATS,
    FieldDescriptor.TYPE_DOUBLE: _FLOATS,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=12),
}


def _scalar_fields(descriptor) -> dict[str, st.SearchStrategy]:
    """One strategy per scalar field (repeated ones as short lists); others are skipped."""
    fields = {}
    for f in descriptor.fields:
        strategy = _BY_TYPE.get(f.type)
        if strategy is None:
            continue
        fields[f.name] = st.lists(strategy, max_size=4) if f.is_repeated else strategy
    return fields


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParameters()
    sampling_fields = _scalar_fields(generation_pb2.SamplingParameters.DESCRIPTOR)
    for name in draw(st.lists(st.sampled_from(sorted(sampling_fields)), max_size=8)):
        value = draw(sampling_fields[name])
        if isinstance(value, list):
            getattr(sampling, name).extend(value)
        else:
            setattr(sampling, name, value)
    msg = generation_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=8)),
        priority=draw(_BY_TYPE[FieldDescriptor.TYPE_INT32]),
        sampling=sampling,
    )
    kind = draw(st.sampled_from(["text", "token_ids", "messages"]))
    if kind == "text":
        msg.text = draw(st.text(max_size=20))
    elif kind == "token_ids":
        msg.token_ids.ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6)))
    else:
        roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "x"])
        for role, content in draw(st.lists(st.tuples(roles, st.text(max_size=12)), max_size=3)):
            msg.messages.messages.add(role=role, content=content)
        if draw(st.booleans()):
            msg.add_generation_prompt = draw(st.booleans())
        msg.continue_final_message = draw(st.booleans())
    if draw(st.booleans()):
        msg.cache_salt = draw(st.text(max_size=6))
    return msg


@pytest.fixture
def public_port(engine: FakeEngineClient, tokenizer, registry) -> Iterator[int]:
    """The Generation service on a loopback port, on its own loop in a thread."""
    loop = asyncio.new_event_loop()
    services: list[GrpcService] = []

    async def start() -> int:  # on the server's loop, which grpc.aio binds to
        service = GrpcService("gateway", ["kvmesh.v1.Generation"])
        services.append(service)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(engine, tokenizer, "m", GatewayMetrics.for_registry(registry)),
            service.server,
        )
        return await service.start("127.0.0.1", 0)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    asyncio.run_coroutine_threadsafe(services[0].stop(grace=0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


def test_arbitrary_generate_requests_never_get_internal_or_unknown(public_port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{public_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        answered: set[grpc.StatusCode] = set()

        @settings(
            max_examples=150,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(generate_requests())
        def check(msg: generation_pb2.GenerateRequest) -> None:
            try:
                for _ in stub.Generate(msg, timeout=30):
                    pass
                answered.add(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                assert e.code() not in _SERVER_BUGS, (msg, e.code(), e.details())
                answered.add(e.code())

        check()
    # Both kinds of answer were exercised: accepted streams and refusals.
    assert grpc.StatusCode.OK in answered and grpc.StatusCode.INVALID_ARGUMENT in answered
