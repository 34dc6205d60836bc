"""The engine client resumes requests whose scheduler or detokenizer was lost."""

from __future__ import annotations

import asyncio

import grpc

from kvmesh.gateway.engine.client import GenerationRequest, ModelInfo
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.protos import common_pb2, detokenizer_pb2, scheduler_pb2
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams


class FakeScheduler:
    """Records AddRequest and AbortRequests; answers UNAVAILABLE ``unavailable`` times."""

    def __init__(self, unavailable: int = 0, unknown: tuple[str, ...] = ()) -> None:
        self.added: list[scheduler_pb2.AddRequestRequest] = []
        self.aborted: list[str] = []
        self.unavailable = unavailable
        self.unknown = list(unknown)

    async def AddRequest(self, request, timeout=None):
        if self.unavailable:
            self.unavailable -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "starting"
            )
        self.added.append(request)
        return scheduler_pb2.AddRequestResponse()

    async def AbortRequests(self, request, timeout=None):
        self.aborted.extend(request.request_ids)
        return scheduler_pb2.AbortRequestsResponse()

    async def ResyncRequests(self, request, timeout=None):
        return scheduler_pb2.ResyncRequestsResponse(
            unknown_ids=[rid for rid in request.request_ids if rid in self.unknown]
        )


def _client(scheduler: FakeScheduler, max_migrations: int = 3) -> GrpcEngineClient:
    client = GrpcEngineClient(
        "127.0.0.1:1", "127.0.0.1:1", token_text=str, max_migrations=max_migrations
    )
    client._scheduler = scheduler  # type: ignore[assignment]
    client._model_info = ModelInfo("m", max_model_len=64, vocab_size=100, eos_token_ids=(0,))
    client._subscribed.set()
    return client


def _request(rid: str = "r", max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(
        rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, seed=7), DetokenizeParams()
    )


def _out(rid: str, text: str, tokens: list[int], **fields) -> detokenizer_pb2.DetokenizedOutput:
    return detokenizer_pb2.DetokenizedOutput(request_id=rid, text=text, token_ids=tokens, **fields)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _read_all(stream) -> tuple[str, list[int], str | None]:
    text, tokens, reason = "", [], None
    async for delta in stream:
        text += delta.text
        tokens += delta.token_ids
        reason = delta.finish_reason
    return text, tokens, reason


async def test_a_lost_scheduler_gets_a_continuation_and_the_stream_goes_on() -> None:
    scheduler = FakeScheduler()
    client = _client(scheduler)
    reader = asyncio.ensure_future(_read_all(client.generate(_request())))
    await _settle()
    client._deliver(_out("r", "Hel", [11, 12]))
    scheduler.unavailable = 2  # the restarted scheduler is still starting
    client._resubmit_all("scheduler lost")
    await asyncio.sleep(1.2)  # two refusals, retried
    continuation = scheduler.added[-1]
    assert continuation.request_id == "r~m1" and continuation.num_migrations == 1
    assert list(continuation.resumed_output_token_ids) == [11, 12]
    assert list(continuation.prompt_token_ids) == [1, 2, 3]
    assert continuation.sampling_params.max_tokens == 10  # counted from the original start
    assert continuation.sampling_params.seed == 7
    assert "r" in scheduler.aborted  # in case the old scheduler lives on
    # The new detokenizer replays from the first token: only "lo" and 13 are new.
    client._deliver(_out("r", "late", [99]))  # the old submission: dropped
    client._deliver(_out("r~m1", "Hello", [11, 12, 13], replay=True))
    client._deliver(_out("r~m1", " you", [14], finish_reason=common_pb2.FINISH_REASON_LENGTH))
    assert await reader == ("Hello you", [11, 12, 13, 14], "length")
    await client.close()


async def test_requests_the_scheduler_lost_at_resync_are_resubmitted() -> None:
    scheduler = FakeScheduler(unknown=("gone",))
    client = _client(scheduler)
    readers = [
        asyncio.ensure_future(_read_all(client.generate(_request(r)))) for r in ("kept", "gone")
    ]
    await _settle()
    await client._resync()
    await _settle()
    assert [m.request_id for m in scheduler.added] == ["kept", "gone", "gone~m1"]
    for rid in ("kept", "gone~m1"):
        client._deliver(_out(rid, "x", [5], finish_reason=common_pb2.FINISH_REASON_STOP))
    assert [await r for r in readers] == [("x", [5], "stop")] * 2
    await client.close()


async def test_a_request_whose_last_output_was_lost_finishes_without_the_engine() -> None:
    scheduler = FakeScheduler()
    client = _client(scheduler)
    reader = asyncio.ensure_future(_read_all(client.generate(_request(max_tokens=2))))
    await _settle()
    client._deliver(_out("r", "ab", [11, 12]))  # max_tokens reached; its final went missing
    client._resubmit_all("not held by the scheduler at resync")
    assert await reader == ("ab", [11, 12], "length")
    assert [m.request_id for m in scheduler.added] == ["r"]
    await client.close()


async def test_past_max_migrations_the_request_fails_saying_so() -> None:
    scheduler = FakeScheduler()
    client = _client(scheduler, max_migrations=1)
    stream = client.generate(_request())
    first = asyncio.ensure_future(stream.__anext__())
    await _settle()
    client._deliver(_out("r", "a", [11]))
    assert (await first).text == "a"
    client._resubmit_all("scheduler lost")
    second = asyncio.ensure_future(stream.__anext__())
    await _settle()
    client._resubmit_all("scheduler lost")
    delta = await second
    assert delta.finish_reason == "error" and "--max-migrations 1" in (delta.error or "")
    assert [m.request_id for m in scheduler.added] == ["r", "r~m1"]
    await client.close()
