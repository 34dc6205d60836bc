"""A gateway that leaves, or falls too far behind, gets its requests aborted in the scheduler."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from kvmesh.detokenizer import service
from kvmesh.detokenizer.registry import DetokenizerTable
from kvmesh.detokenizer.service import DetokenizerEngine, DetokenizerServicer
from kvmesh.protos import common_pb2, detokenizer_pb2, scheduler_pb2
from kvmesh.services.contracts.errors import OverloadedError


class RecordingScheduler:
    """The scheduler stub as the detokenizer calls it; records AbortRequests."""

    def __init__(self) -> None:
        self.aborted_clients: list[str] = []

    async def AbortRequests(self, request, timeout=None):
        self.aborted_clients.append(request.client_id)
        return scheduler_pb2.AbortRequestsResponse()


def _engine(tokenizer: Tokenizer) -> tuple[DetokenizerEngine, RecordingScheduler]:
    engine = DetokenizerEngine(DetokenizerTable(tokenizer), "unused:1")
    scheduler = RecordingScheduler()
    engine._stub = scheduler  # type: ignore[assignment]
    return engine, scheduler


def _step(step_id: int, client: str) -> scheduler_pb2.StepOutputs:
    output = scheduler_pb2.RequestOutput(
        request_id=f"r{step_id}",
        new_token_ids=[42],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        header=scheduler_pb2.RequestHeader(prompt_token_ids=[1, 2], client_id=client),
    )
    return scheduler_pb2.StepOutputs(step_id=step_id, outputs=[output])


class StreamContext:
    async def send_initial_metadata(self, metadata) -> None:
        return None


async def test_a_gateway_whose_stream_ends_has_its_requests_aborted(tokenizer) -> None:
    engine, scheduler = _engine(tokenizer)
    old = engine.subscribe("gw")
    new = engine.subscribe("gw")  # resubscribed before the old stream's end was seen
    engine.unsubscribe("gw", old)
    await asyncio.sleep(0)
    assert scheduler.aborted_clients == []  # the gateway is still there
    engine.unsubscribe("gw", new)
    await asyncio.sleep(0)
    assert scheduler.aborted_clients == ["gw"]


async def test_a_gateway_too_far_behind_is_cut_off_and_its_requests_aborted(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "_MAX_GATEWAY_BACKLOG", 3)
    engine, scheduler = _engine(tokenizer)
    stream = DetokenizerServicer(engine).StreamDetokenized(
        detokenizer_pb2.StreamDetokenizedRequest(client_id="slow"), StreamContext()
    )
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # subscribed, waiting for the first batch
    for step_id in range(1, 6):
        per_client, _ = engine.process_step(_step(step_id, "slow"))
        engine._route(step_id, per_client)
    await asyncio.sleep(0)
    assert scheduler.aborted_clients == ["slow"]
    with pytest.raises(OverloadedError, match="behind"):
        await first  # its stream ends; the gateway fails its requests and resubscribes
    assert "slow" not in engine._subscribers
