"""Internal auth on real grpc.aio servers: an outsider can neither submit steps nor read outputs.

Fake servicers stand in for the worker and the detokenizer (the method paths,
and so the checks, are the real services'); the kvstore is the real one. Each
call shape is covered: unary (Worker.GetInfo), server stream
(Detokenizer.StreamDetokenized), bidirectional (Worker.Execute) and client
stream (KVStore.PutBlocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.testing import serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import detokenizer_pb2, detokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.services.runtime.grpc_security import (
    NO_INTERNAL_AUTH,
    TOKEN_METADATA_KEY,
    InternalSecurity,
)
from kvmesh.services.runtime.grpc_server import GrpcService, internal_channel, probe_channel
from kvmesh.services.runtime.stack_credentials import make_stack_certificates

TOKEN = "stack-token-for-tests"
STACK = InternalSecurity(token=TOKEN)
LAYOUT = KVLayout(model="m", dtype="float32", block_size=16, layout_version=1)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


class _EchoWorker(worker_pb2_grpc.WorkerServicer):
    async def GetInfo(self, request, context) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(model_name="m")

    async def Execute(self, request_iterator, context) -> AsyncIterator[worker_pb2.StepResult]:
        async for request in request_iterator:
            yield worker_pb2.StepResult(step_id=request.step_id)


class _OneBatchDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    async def StreamDetokenized(self, request, context):
        yield detokenizer_pb2.DetokenizedBatch(step_id=7)


@contextlib.asynccontextmanager
async def _serve(access: InternalSecurity) -> AsyncIterator[str]:
    """A worker and a detokenizer on one port, behind ``access``; yields the address."""
    names = [
        worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
        detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name,
    ]
    service = GrpcService("worker+detokenizer", names, access=access)
    worker_pb2_grpc.add_WorkerServicer_to_server(_EchoWorker(), service.server)
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(_OneBatchDetokenizer(), service.server)
    port = await service.start("127.0.0.1", 0)
    await service.set_serving(True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await service.stop(grace=0)


async def _calls(channel: grpc.aio.Channel) -> tuple[str, int, int]:
    """GetInfo's model, the step id Execute echoes, the detokenizer's first batch's step id."""
    worker = worker_pb2_grpc.WorkerStub(channel)
    info = await worker.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
    steps = worker.Execute(iter([worker_pb2.StepRequest(step_id=3)]), timeout=5)
    echoed = [result.step_id async for result in steps]
    stream = detokenizer_pb2_grpc.DetokenizerStub(channel).StreamDetokenized(
        detokenizer_pb2.StreamDetokenizedRequest(client_id="g"), timeout=5
    )
    batches = [batch.step_id async for batch in stream]
    return info.model_name, echoed[0], batches[0]


async def _refusal(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value.code()


async def _stream_refusal(stream) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stream:
            pass
    return refused.value.code()


async def test_calls_with_the_stack_token_are_served() -> None:
    async with _serve(STACK) as address, internal_channel(address, STACK) as channel:
        assert await _calls(channel) == ("m", 3, 7)


@pytest.mark.parametrize("metadata", [(), ((TOKEN_METADATA_KEY, "guessed"),)])
async def test_a_caller_without_the_token_can_neither_step_the_worker_nor_read_outputs(
    metadata: tuple[tuple[str, str], ...],
) -> None:
    async with _serve(STACK) as address, grpc.aio.insecure_channel(address) as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        # No request sent: the refusal comes before the server reads any, and a
        # client still writing its request into a stream the server has already
        # refused can see INTERNAL ("failed to write") instead (seen once under load).
        steps = worker.Execute(iter(()), metadata=metadata)
        assert await _stream_refusal(steps) == grpc.StatusCode.UNAUTHENTICATED
        info = worker.GetInfo(worker_pb2.GetWorkerInfoRequest(), metadata=metadata)
        assert await _refusal(info) == grpc.StatusCode.UNAUTHENTICATED
        outputs = detokenizer_pb2_grpc.DetokenizerStub(channel).StreamDetokenized(
            detokenizer_pb2.StreamDetokenizedRequest(client_id="intruder"), metadata=metadata
        )
        assert await _stream_refusal(outputs) == grpc.StatusCode.UNAUTHENTICATED


async def test_health_checks_stay_open_without_the_token() -> None:
    async with _serve(STACK) as address, grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_port_without_a_token_serves_anyone() -> None:
    async with _serve(NO_INTERNAL_AUTH) as address, grpc.aio.insecure_channel(address) as channel:
        assert await _calls(channel) == ("m", 3, 7)


async def test_kvstore_puts_need_the_token() -> None:
    """A client stream (PutBlocks) through the real kvstore servicer and client."""
    blocks = [(b"h" * 16, b"x" * 64)]
    async with serve_store(TieredStore(1 << 20), access=STACK) as address:
        async with KVStoreClient(address, timeout_s=5, security=STACK) as client:
            assert len(await client.put_blocks(LAYOUT, blocks)) == 1
        async with KVStoreClient(address, timeout_s=5) as outsider:
            with pytest.raises(Exception, match="UNAUTHENTICATED"):
                await outsider.put_blocks(LAYOUT, blocks)


@pytest.fixture(scope="module")
def stack_certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InternalSecurity]:
    """Mutual TLS of this stack and of another one (a CA of its own)."""
    made = {}
    for name in ("ours", "theirs"):
        certs = make_stack_certificates(Path(tmp_path_factory.mktemp(name)))
        made[name] = InternalSecurity(
            token=TOKEN,
            certfile=str(certs.certfile),
            keyfile=str(certs.keyfile),
            ca_certs=str(certs.ca_certs),
        )
    return made


@needs_openssl
async def test_mutual_tls_serves_only_holders_of_the_stack_certificate(
    stack_certificates: dict[str, InternalSecurity],
) -> None:
    ours, theirs = stack_certificates["ours"], stack_certificates["theirs"]
    async with _serve(ours) as address:
        async with internal_channel(address, ours) as channel:
            assert await _calls(channel) == ("m", 3, 7)
        # Plaintext, another stack's certificate (with the right token even): no handshake.
        for outsider in (STACK, theirs):
            async with internal_channel(address, outsider) as channel:
                info = worker_pb2_grpc.WorkerStub(channel).GetInfo(
                    worker_pb2.GetWorkerInfoRequest(), timeout=5
                )
                assert await _refusal(info) == grpc.StatusCode.UNAVAILABLE


def _probe_serving(address: str, security: InternalSecurity) -> bool:
    with probe_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@needs_openssl
async def test_health_probes_present_the_certificate_under_mutual_tls(
    stack_certificates: dict[str, InternalSecurity],
) -> None:
    ours = stack_certificates["ours"]
    async with _serve(ours) as address:
        # Blocking probes (as the launcher's) run beside the server's event loop.
        assert await asyncio.to_thread(_probe_serving, address, ours)
        assert not await asyncio.to_thread(_probe_serving, address, NO_INTERNAL_AUTH)
