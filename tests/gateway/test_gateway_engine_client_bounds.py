"""The gRPC engine client: a reader that falls behind is failed and aborted; so are the
requests of a broken detokenizer stream; AddRequest calls in flight are bounded."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.gateway.engine import grpc_client
from kvmesh.gateway.engine.client import GenerationRequest
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.protos import common_pb2, detokenizer_pb2, scheduler_pb2
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams


class FakeScheduler:
    """The scheduler stub as the engine client calls it."""

    def __init__(self) -> None:
        self.aborted: list[list[str]] = []
        self.admitting = 0
        self.most_admitting = 0
        self.release = asyncio.Event()
        self.release.set()

    async def AddRequest(self, request, timeout=None):
        self.admitting += 1
        self.most_admitting = max(self.most_admitting, self.admitting)
        await self.release.wait()
        self.admitting -= 1
        return scheduler_pb2.AddRequestResponse()

    async def AbortRequests(self, request, timeout=None):
        self.aborted.append(list(request.request_ids))
        return scheduler_pb2.AbortRequestsResponse()


def _client() -> tuple[GrpcEngineClient, FakeScheduler]:
    client = GrpcEngineClient("127.0.0.1:1", "127.0.0.1:1", token_text=str)
    scheduler = FakeScheduler()
    client._scheduler = scheduler  # type: ignore[assignment]
    client._subscribed.set()
    return client, scheduler


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=100), DetokenizeParams())


def _output(rid: str, token: int) -> detokenizer_pb2.DetokenizedOutput:
    return detokenizer_pb2.DetokenizedOutput(request_id=rid, token_ids=[token], text="x")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_reader_too_far_behind_is_failed_and_aborted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grpc_client, "_MAX_UNREAD_DELTAS", 3)
    client, scheduler = _client()
    stream = client.generate(_request("slow"))
    first = asyncio.ensure_future(stream.__anext__())
    await _settle()
    client._deliver(_output("slow", 7))
    assert (await first).token_ids == [7]
    for token in range(10):  # the reader stopped reading
        client._deliver(_output("slow", token))
    await _settle()
    failed = await stream.__anext__()  # ahead of what was never read
    assert failed.finish_reason == "error" and "3 steps behind" in (failed.error or "")
    assert scheduler.aborted == [["slow"]]
    await stream.aclose()
    await client.close()


async def test_a_broken_detokenizer_stream_fails_and_aborts_every_request() -> None:
    client, scheduler = _client()
    streams = [client.generate(_request(rid)) for rid in ("a", "b")]
    reads = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await _settle()
    client._fail_all("detokenizer unavailable")
    for read in reads:
        delta = await read
        assert delta.finish_reason == "error" and delta.error == "detokenizer unavailable"
    await _settle()
    assert scheduler.aborted == [["a", "b"]]
    # Late outputs for them are dropped, not queued.
    client._deliver(_output("a", 1))
    assert client._live == {} and client._by_engine_id == {}
    await client.close()


async def test_add_request_calls_in_flight_are_bounded() -> None:
    client, scheduler = _client()
    client._admissions = asyncio.Semaphore(2)
    scheduler.release.clear()
    streams = [client.generate(_request(f"r{i}")) for i in range(5)]
    reads = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await _settle()
    assert scheduler.admitting == 2  # the others wait in the gateway, not in the scheduler
    scheduler.release.set()
    await _settle()
    assert scheduler.most_admitting == 2
    for index, read in enumerate(reads):
        client._deliver(
            detokenizer_pb2.DetokenizedOutput(
                request_id=f"r{index}", finish_reason=common_pb2.FINISH_REASON_LENGTH
            )
        )
        assert (await read).finish_reason == "length"
    await client.close()
