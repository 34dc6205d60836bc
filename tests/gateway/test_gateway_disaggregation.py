"""The gateway's prefill step (``--prefill-scheduler-addr``): the transfer reaches the decode
scheduler, and no prefill failure ever fails the request.

One in-process gRPC server plays both schedulers (Prefill on one, AddRequest on
the other) and a silent detokenizer; its AddRequest records what arrived, then
refuses with whatever the test sets, so each submission ends right there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from kvmesh.gateway.engine.client import GenerationRequest
from kvmesh.gateway.engine.disaggregation import PrefillClient
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.protos import detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvmesh.services.contracts.errors import KvmeshError, OverloadedError, UnavailableError
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams
from kvmesh.services.runtime.grpc_server import GrpcService
from tests.gateway.test_gateway_error_kinds import _SilentDetokenizer

TRANSFER = scheduler_pb2.KVTransferParams(lease_ids=[7], num_stored_tokens=32)


class _Schedulers(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        # Prefill answers this, raises it, or (None) hangs until cancelled.
        self.prefill_reply: scheduler_pb2.PrefillResponse | Exception | None = (
            scheduler_pb2.PrefillResponse(kv_transfer=TRANSFER)
        )
        self.prefills: list[scheduler_pb2.PrefillRequest] = []
        self.prefill_cancelled = asyncio.Event()
        # What a hanging prefill ends with once AbortRequests names it: aborted
        # while computing (an error, as the real prefill replica answers) or
        # already done and saving (its transfer comes all the same).
        self.abort_ends_prefill_with: scheduler_pb2.PrefillResponse | Exception = UnavailableError(
            "prefill failed: aborted"
        )
        self._hanging: asyncio.Future[scheduler_pb2.PrefillResponse] | None = None
        self.added: list[scheduler_pb2.AddRequestRequest] = []
        self.refuse_with: KvmeshError | None = OverloadedError("decode queue is full")
        self.add_delay_s = 0.0
        # AddRequest and AbortRequests in the order they arrived at either scheduler.
        self.calls: list[tuple[str, list[str]]] = []

    async def GetInfo(self, request, context) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=[2]
        )

    async def Prefill(self, request, context) -> scheduler_pb2.PrefillResponse:
        self.prefills.append(request)
        reply = self.prefill_reply
        if isinstance(reply, Exception):
            raise reply
        if reply is None:
            self._hanging = asyncio.get_running_loop().create_future()
            try:
                return await self._hanging
            except asyncio.CancelledError:
                self.prefill_cancelled.set()
                raise
        return reply

    async def AddRequest(self, request, context) -> scheduler_pb2.AddRequestResponse:
        self.added.append(request)
        await asyncio.sleep(self.add_delay_s)
        self.calls.append(("AddRequest", [request.request_id]))
        if self.refuse_with is not None:
            raise self.refuse_with
        return scheduler_pb2.AddRequestResponse()

    async def AbortRequests(self, request, context) -> scheduler_pb2.AbortRequestsResponse:
        self.calls.append(("AbortRequests", list(request.request_ids)))
        if self._hanging is not None and not self._hanging.done():
            ending = self.abort_ends_prefill_with
            if isinstance(ending, Exception):
                self._hanging.set_exception(ending)
            else:
                self._hanging.set_result(ending)
        return scheduler_pb2.AbortRequestsResponse()


@contextlib.asynccontextmanager
async def _gateway(
    prefill_timeout_s: float = 5.0, prefill_addr: str | None = None
) -> AsyncIterator[tuple[_Schedulers, GrpcEngineClient]]:
    schedulers = _Schedulers()
    service = GrpcService("schedulers+detokenizer", [])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(schedulers, service.server)
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(_SilentDetokenizer(), service.server)
    address = f"127.0.0.1:{await service.start('127.0.0.1', 0)}"
    prefill = PrefillClient(prefill_addr or address, prefill_timeout_s)
    engine = GrpcEngineClient(address, address, token_text=str, prefill=prefill)
    try:
        await engine.start(timeout=10)
        yield schedulers, engine
    finally:
        await engine.close()
        await service.stop(grace=0)


async def _submit(engine: GrpcEngineClient, cache_salt: str | None = None) -> None:
    request = GenerationRequest(
        request_id="r",
        prompt_token_ids=list(range(40)),
        sampling_params=SamplingParams(max_tokens=4),
        detokenize_params=DetokenizeParams(),
        priority=3,
        cache_salt=cache_salt,
    )
    async for _ in engine.generate(request):
        pytest.fail("the fake decode scheduler refuses every request")


async def test_the_prefill_transfer_travels_with_the_request_to_the_decode_replica() -> None:
    async with _gateway() as (schedulers, engine):
        with pytest.raises(OverloadedError):
            await _submit(engine, cache_salt="tenant")
        (prefill,) = schedulers.prefills
        assert prefill.request_id == "r" and list(prefill.prompt_token_ids) == list(range(40))
        assert prefill.cache_salt == "tenant" and prefill.priority == 3
        (added,) = schedulers.added
        assert added.kv_transfer == TRANSFER
        assert added.cache_salt == "tenant"


async def test_the_decode_replica_refusing_is_the_clients_error_after_a_prefill() -> None:
    """Queue full on the decode side: the client gets the 429 (the decode scheduler
    ends the lease it was handed, tests/scheduler/test_scheduler_prefill.py)."""
    async with _gateway() as (schedulers, engine):
        schedulers.refuse_with = OverloadedError("decode queue is full")
        with pytest.raises(OverloadedError, match="decode queue is full"):
            await _submit(engine)
        assert len(schedulers.prefills) == 1 and schedulers.added[0].HasField("kv_transfer")


@pytest.mark.parametrize(
    "failure",
    [
        UnavailableError("prefill worker lost"),
        OverloadedError("prefill queue is full"),
        RuntimeError("a bug in the prefill replica"),
        None,  # hangs past the gateway's prefill timeout
        scheduler_pb2.PrefillResponse(kv_transfer=scheduler_pb2.KVTransferParams()),
    ],
    ids=["unavailable", "overloaded", "internal", "timeout", "nothing_to_transfer"],
)
async def test_any_prefill_failure_falls_back_to_decode_only(failure) -> None:
    async with _gateway(prefill_timeout_s=0.3) as (schedulers, engine):
        schedulers.prefill_reply = failure
        with pytest.raises(OverloadedError):
            await _submit(engine)
        (added,) = schedulers.added  # submitted all the same, computed by the decode replica
        assert not added.HasField("kv_transfer")


async def test_an_unreachable_prefill_replica_falls_back_to_decode_only() -> None:
    async with _gateway(prefill_timeout_s=2.0, prefill_addr="127.0.0.1:1") as (schedulers, engine):
        with pytest.raises(OverloadedError):
            await _submit(engine)
        assert not schedulers.added[0].HasField("kv_transfer")


async def _leave_once(engine: GrpcEngineClient, started: Callable[[], bool]) -> None:
    """Submit, let the client go once ``started()`` holds, and wait for the
    gateway's background work."""
    client = asyncio.create_task(_submit(engine))
    while not started():
        await asyncio.sleep(0.01)
    client.cancel()
    with pytest.raises(asyncio.CancelledError):
        await client
    await _settled(engine)


async def _leave_during_the_prefill(schedulers: _Schedulers, engine: GrpcEngineClient) -> None:
    schedulers.prefill_reply = None  # the prefill runs until aborted
    await _leave_once(engine, lambda: bool(schedulers.prefills))


async def _settled(engine: GrpcEngineClient) -> None:
    """Wait for the gateway's background aborts and admissions."""
    for _ in range(500):
        if not engine._background:
            return
        await asyncio.sleep(0.01)
    pytest.fail("background work never ended")


async def test_a_client_gone_during_the_prefill_aborts_it_and_submits_nothing() -> None:
    """The call is aborted, not cancelled: a cancelled call could lose a lease the
    prefill replica had just taken (gateway/engine/disaggregation.py)."""
    async with _gateway() as (schedulers, engine):
        await _leave_during_the_prefill(schedulers, engine)
        assert schedulers.calls == [("AbortRequests", ["r"])]
        assert schedulers.added == [] and not schedulers.prefill_cancelled.is_set()


async def test_a_transfer_that_comes_after_the_client_left_is_handed_over_then_aborted() -> None:
    """The prefill was done (its blocks saving) when the abort came: its leases go to
    the decode replica, which ends them once the request is aborted there."""
    async with _gateway() as (schedulers, engine):
        schedulers.abort_ends_prefill_with = scheduler_pb2.PrefillResponse(kv_transfer=TRANSFER)
        schedulers.refuse_with = None
        await _leave_during_the_prefill(schedulers, engine)
        assert schedulers.calls == [
            ("AbortRequests", ["r"]),  # at the prefill replica
            ("AddRequest", ["r"]),
            ("AbortRequests", ["r"]),  # at the decode replica, after the admission
        ]
        assert schedulers.added[0].kv_transfer == TRANSFER


async def test_a_client_gone_during_the_admission_is_aborted_after_it() -> None:
    """An abort that overtook the AddRequest would find nothing there and leave the
    request (and the leases it holds) to run: it waits for the admission."""
    async with _gateway() as (schedulers, engine):
        schedulers.refuse_with = None
        schedulers.add_delay_s = 0.3
        await _leave_once(engine, lambda: bool(schedulers.added))
        assert schedulers.calls == [("AddRequest", ["r"]), ("AbortRequests", ["r"])]
        assert schedulers.added[0].kv_transfer == TRANSFER
