"""The scheduler service around the core: admission errors, headers, aborts, and request
migration (a lost worker or detokenizer costs time, not requests)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.protos import common_pb2, scheduler_pb2, worker_pb2
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.service import SchedulerEngine, SchedulerServicer
from kvmesh.services.contracts.errors import InvalidRequestError, OverloadedError, UnavailableError
from kvmesh.services.contracts.step import ModelRunnerOutput
from kvmesh.services.contracts.step_deadline import StepDeadline, StepDeadlinePolicy
from tests.scheduler.test_scheduler_engine_async import InMemoryWorkerClient


class DyingWorkerClient(InMemoryWorkerClient):
    """Answers ``healthy_steps`` steps, then behaves like a broken stream."""

    def __init__(self, healthy_steps: int) -> None:
        super().__init__()
        self.healthy_steps = healthy_steps

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        if self.healthy_steps <= 0:
            raise UnavailableError("worker stream failed: UNAVAILABLE")
        self.healthy_steps -= 1
        return await super().receive(step_id)

    async def connect(self, timeout: float):  # the reconnect loop: never comes back here
        await asyncio.sleep(3600)


class HangingWorkerClient(DyingWorkerClient):
    """Answers ``healthy_steps`` steps, then never answers again (stopped, deadlocked)."""

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        if self.healthy_steps <= 0:
            await asyncio.sleep(3600)
        return await super().receive(step_id)


def _engine(
    worker,
    max_waiting: int = 100,
    step_deadline: StepDeadline | None = None,
    max_migrations: int = 3,
    subscriber_grace_s: float = 60.0,
) -> SchedulerEngine:
    config = SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64)
    return SchedulerEngine(
        config,
        worker,
        [2],
        SchedulerMetrics("test", registry=CollectorRegistry()),
        max_waiting_requests=max_waiting,
        step_deadline=step_deadline,
        max_migrations=max_migrations,
        subscriber_grace_s=subscriber_grace_s,
    )


def _add(engine: SchedulerEngine, rid: str, max_tokens: int = 4, client: str = "gw") -> None:
    engine.add_request(
        scheduler_pb2.AddRequestRequest(
            request_id=rid,
            prompt_token_ids=[5, 6, 7, 8, 9],
            sampling_params=common_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0
            ),
            detokenize_params=common_pb2.DetokenizeParams(stop=["x"]),
            client_id=client,
        )
    )


def test_admission_errors_are_typed() -> None:
    engine = _engine(InMemoryWorkerClient(), max_waiting=2)
    with pytest.raises(UnavailableError, match="detokenizer"):
        _add(engine, "a")  # nobody would receive its outputs
    engine.subscribe()
    _add(engine, "a")
    with pytest.raises(InvalidRequestError, match="already in use"):
        _add(engine, "a")
    _add(engine, "b")
    with pytest.raises(OverloadedError):
        _add(engine, "c")  # two already waiting: the bound


def test_a_prompt_that_could_never_run_is_the_callers_error() -> None:
    engine = _engine(InMemoryWorkerClient())
    engine.subscribe()
    too_long = scheduler_pb2.AddRequestRequest(request_id="long", prompt_token_ids=[5] * 65)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request(too_long)  # the core's ValueError, converted at the service edge
    assert engine.core.get_request("long") is None


async def _run_until(engine, queue, done, timeout=10.0) -> list[scheduler_pb2.RequestOutput]:
    stop = asyncio.Event()
    task = asyncio.create_task(engine.run(stop))
    outputs: list[scheduler_pb2.RequestOutput] = []
    try:
        while not done(outputs):
            batch = await asyncio.wait_for(queue.get(), timeout=timeout)
            outputs.extend(batch.outputs)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    return outputs


async def test_first_output_carries_the_header_once() -> None:
    engine = _engine(InMemoryWorkerClient())
    _, queue = engine.subscribe()
    _add(engine, "a", client="gw-1")
    outputs = await _run_until(engine, queue, lambda outs: any(o.finish_reason for o in outs))
    with_header = [o for o in outputs if o.HasField("header")]
    assert len(with_header) == 1 and with_header[0] is outputs[0]
    header = with_header[0].header
    assert list(header.prompt_token_ids) == [5, 6, 7, 8, 9]
    assert header.client_id == "gw-1" and list(header.detokenize_params.stop) == ["x"]
    assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def abort_one_and_stop_the_other(engine: SchedulerEngine) -> None:
    """Run "long" and "stopped" until their first outputs, then abort the first
    and end the second by a stop string; return once both are gone."""
    _, queue = engine.subscribe()
    _add(engine, "long", max_tokens=40)
    _add(engine, "stopped", max_tokens=40)
    seen: set[str] = set()

    def control(outputs) -> bool:
        for o in outputs:
            if o.request_id not in seen:
                seen.add(o.request_id)
                if o.request_id == "long":
                    engine.abort(["long"])
                else:
                    engine.finish_on_stop_string(["stopped"])
        return len(seen) == 2 and not engine.core.has_unfinished_requests()

    await _run_until(engine, queue, control)


async def test_abort_and_stop_string_free_everything() -> None:
    engine = _engine(InMemoryWorkerClient())
    await abort_one_and_stop_the_other(engine)
    assert engine.core.live_request_ids() == []
    engine.core.check_integrity()
    assert engine.core.make_stats().kv_cache_usage == 0


class RestartingWorkerClient(InMemoryWorkerClient):
    """Answers ``healthy_steps`` steps, breaks, and comes back empty (a restarted worker)."""

    def __init__(self, healthy_steps: int, num_kv_blocks: int = 32) -> None:
        super().__init__()
        self.healthy_steps = healthy_steps
        self.num_kv_blocks = num_kv_blocks
        self.restarts = 0

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        if self.healthy_steps == 0:
            self.healthy_steps = -1  # dead once, healthy after the restart
            raise UnavailableError("worker stream failed: UNAVAILABLE")
        self.healthy_steps -= 1
        return await super().receive(step_id)

    async def connect(self, timeout: float) -> worker_pb2.WorkerInfo:
        # A new process: no request, no KV, nothing of the steps sent before.
        self.queue.clear()
        self.tokens.clear()
        self.num_computed.clear()
        self.restarts += 1
        return worker_pb2.WorkerInfo(num_kv_blocks=self.num_kv_blocks)


def _tokens_by_request(outputs: list[scheduler_pb2.RequestOutput]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


async def _generate(worker, max_migrations: int = 3) -> list[scheduler_pb2.RequestOutput]:
    engine = _engine(worker, max_migrations=max_migrations)
    _, queue = engine.subscribe()
    for rid in ("a", "b", "c"):
        _add(engine, rid, max_tokens=12)
    outputs = await _run_until(
        engine, queue, lambda outs: sum(bool(o.finish_reason) for o in outs) == 3
    )
    assert engine.core.live_request_ids() == []
    engine.core.check_integrity()
    assert engine.core.make_stats().kv_cache_usage == 0
    return outputs


async def test_a_lost_worker_costs_time_not_requests() -> None:
    """Running requests wait for the restarted worker with their tokens so far, which
    recomputes their KV: every token stream equals the undisturbed run's."""
    undisturbed = _tokens_by_request(await _generate(InMemoryWorkerClient()))
    worker = RestartingWorkerClient(healthy_steps=5)
    outputs = await _generate(worker)
    assert worker.restarts == 1
    assert _tokens_by_request(outputs) == undisturbed
    finals = [o for o in outputs if o.finish_reason]
    assert {o.finish_reason for o in finals} == {common_pb2.FINISH_REASON_LENGTH}
    # Each request's header went out once: the detokenizer's state lives on.
    assert sorted(o.request_id for o in outputs if o.HasField("header")) == ["a", "b", "c"]


async def test_a_request_past_max_migrations_fails_with_a_clear_error() -> None:
    outputs = await _generate(RestartingWorkerClient(healthy_steps=5), max_migrations=0)
    finals = {o.request_id: o for o in outputs if o.finish_reason}
    assert set(finals) == {"a", "b", "c"}
    for final in finals.values():
        assert final.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "worker unavailable" in final.error and "--max-migrations 0" in final.error


async def test_a_hung_worker_is_failed_over_at_its_step_deadline() -> None:
    policy = StepDeadlinePolicy(min_s=0.2, cold_s=0.5, warm_steps=2)
    engine = _engine(
        HangingWorkerClient(healthy_steps=4), step_deadline=StepDeadline(policy), max_migrations=0
    )
    _, queue = engine.subscribe()
    _add(engine, "a", max_tokens=40)
    started = asyncio.get_running_loop().time()
    outputs = await _run_until(engine, queue, lambda outs: any(o.finish_reason for o in outs))
    waited = asyncio.get_running_loop().time() - started
    final = outputs[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "hung" in final.error
    # Two cold steps, two measured: the 0.2 s floor applies, not the 0.5 s cold deadline.
    assert 0.2 <= waited < 0.5
    assert not engine.healthy
    assert engine.core.live_request_ids() == []


async def test_an_abort_releases_downstream_state_only_of_requests_seen_downstream() -> None:
    engine = _engine(InMemoryWorkerClient())
    _, queue = engine.subscribe()
    _add(engine, "started", max_tokens=40)
    outputs = await _run_until(engine, queue, lambda outs: len(outs) >= 2)
    assert outputs[0].HasField("header")
    _add(engine, "unseen", max_tokens=40)
    assert sorted(engine.abort(["started", "unseen", "unknown"])) == ["started", "unseen"]
    engine._apply_pending_control()
    (batch,) = [queue.get_nowait() for _ in range(queue.qsize())][-1:]
    (final,) = batch.outputs  # nothing for "unseen": the detokenizer never heard of it
    assert final.request_id == "started"
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORT and not final.new_token_ids
    assert engine.core.live_request_ids() == [] and engine._client_of == {}


async def test_a_gone_gateways_requests_are_aborted_by_its_client_id() -> None:
    engine = _engine(InMemoryWorkerClient())
    engine.subscribe()
    servicer = SchedulerServicer(engine, scheduler_pb2.SchedulerInfo())
    for rid, client in [("a1", "gw-a"), ("a2", "gw-a"), ("b1", "gw-b")]:
        _add(engine, rid, client=client)
    reply = await servicer.AbortRequests(
        scheduler_pb2.AbortRequestsRequest(client_id="gw-a"), context=None
    )
    assert sorted(reply.aborted_ids) == ["a1", "a2"]
    engine._apply_pending_control()
    assert engine.core.live_request_ids() == ["b1"]
    assert engine.requests_of_client("gw-a") == []


async def test_requests_wait_for_a_new_subscriber_then_are_republished() -> None:
    """The detokenizer restarts: the loop holds its steps meanwhile; the new one first
    gets every request's header with every token so far, and so does a gateway's resync."""
    engine = _engine(InMemoryWorkerClient())
    key, queue = engine.subscribe()
    _add(engine, "a", max_tokens=40)
    _add(engine, "b", max_tokens=40)
    stop = asyncio.Event()
    task = asyncio.create_task(engine.run(stop))
    try:
        first = await asyncio.wait_for(queue.get(), 5)
        engine.unsubscribe(key)
        await asyncio.sleep(0.05)
        request = engine.core.get_request("a")
        held = request.num_output_tokens
        await asyncio.sleep(0.05)
        assert request.num_output_tokens == held  # paused: no step without a listener
        _, queue = engine.subscribe()
        on_return = (await asyncio.wait_for(queue.get(), 5)).outputs
        assert engine.resync(["a", "gone"]) == ["gone"]
        while True:  # the resync's replay comes after a few more steps
            resynced = (await asyncio.wait_for(queue.get(), 5)).outputs
            if resynced[0].HasField("header"):
                break
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert {o.request_id for o in first.outputs if o.HasField("header")} == {"a", "b"}
    assert sorted(o.request_id for o in on_return) == ["a", "b"]
    for replay in [*on_return, *resynced]:
        assert replay.HasField("header") and not replay.new_token_ids
        assert list(replay.header.prompt_token_ids) == [5, 6, 7, 8, 9]
    (replay_a,) = [o for o in on_return if o.request_id == "a"]
    assert list(replay_a.header.output_token_ids) == request.output_token_ids[:held]
    assert [o.request_id for o in resynced] == ["a"]
    assert len(resynced[0].header.output_token_ids) >= held


async def test_requests_are_aborted_when_no_subscriber_returns_in_time() -> None:
    engine = _engine(InMemoryWorkerClient(), subscriber_grace_s=0.1)
    first, _ = engine.subscribe()
    second, _ = engine.subscribe()
    _add(engine, "a")
    engine.unsubscribe(first)
    engine._apply_pending_control()
    assert engine.core.live_request_ids() == ["a"]  # another detokenizer still routes it
    engine.unsubscribe(second)
    stop = asyncio.Event()
    task = asyncio.create_task(engine.run(stop))
    await asyncio.sleep(0.05)
    assert engine.core.live_request_ids() == ["a"]  # within the grace period: waits
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert engine.core.live_request_ids() == []
    engine.core.check_integrity()


async def test_a_continuation_resumes_with_its_tokens_and_original_budget() -> None:
    """The gateway resubmits a request after losing its scheduler: it picks up where
    the client's stream stopped and ends where the undisturbed run ended."""
    undisturbed = _tokens_by_request(await _generate(InMemoryWorkerClient()))["a"]
    engine = _engine(InMemoryWorkerClient())
    _, queue = engine.subscribe()
    engine.add_request(
        scheduler_pb2.AddRequestRequest(
            request_id="a~m1",
            prompt_token_ids=[5, 6, 7, 8, 9],
            sampling_params=common_pb2.SamplingParams(
                max_tokens=12, ignore_eos=True, temperature=0.0
            ),
            client_id="gw",
            resumed_output_token_ids=undisturbed[:5],
            num_migrations=1,
        )
    )
    outputs = await _run_until(engine, queue, lambda outs: any(o.finish_reason for o in outs))
    assert list(outputs[0].header.output_token_ids) == undisturbed[:5]
    assert _tokens_by_request(outputs)["a~m1"] == undisturbed[5:]
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


class IdleDeathWorkerClient(InMemoryWorkerClient):
    """A worker that dies between steps and comes back when reconnected."""

    def __init__(self) -> None:
        super().__init__()
        self.reconnects = 0

    def die(self) -> None:
        self.connected = False
        self.stream_ended.set()

    async def connect(self, timeout: float):
        self.reconnects += 1
        self.connected = True
        self.stream_ended.clear()
        return worker_pb2.WorkerInfo(num_kv_blocks=32)


async def test_a_worker_dying_between_steps_is_found_out_without_a_request() -> None:
    """Its step stream ended while the scheduler idled: the scheduler must reconnect
    now, not write the next request's step into the dead stream (where it hung)."""
    worker = IdleDeathWorkerClient()
    engine = _engine(worker)
    _, queue = engine.subscribe()
    stop = asyncio.Event()
    task = asyncio.create_task(engine.run(stop))
    try:
        await asyncio.sleep(0.05)  # idle: nothing to step
        worker.die()
        async with asyncio.timeout(5):
            while not worker.reconnects:
                await asyncio.sleep(0.01)
        assert engine.healthy
        _add(engine, "after", max_tokens=3)
        outputs: list[scheduler_pb2.RequestOutput] = []
        async with asyncio.timeout(5):
            while not any(o.finish_reason for o in outputs):
                outputs.extend((await queue.get()).outputs)
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
