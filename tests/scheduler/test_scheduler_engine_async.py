"""The service loop with async scheduling: one step in flight ahead, same published tokens.

The worker client is in memory: ``submit`` queues a step, ``receive`` runs the
oldest one through a simulated worker (so a step runs only once the loop waits
for it, as with the real stream) and records how many steps were outstanding.
"""

from __future__ import annotations

import asyncio
from collections import deque

from prometheus_client import CollectorRegistry

from kvmesh.protos import common_pb2, scheduler_pb2
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.service import SchedulerEngine
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput


class InMemoryWorkerClient:
    def __init__(self) -> None:
        self.queue: deque[SchedulerOutput] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.max_outstanding = 0
        # What the scheduler reads of the step stream between steps (WorkerClient's).
        self.connected = True
        self.stream_ended = asyncio.Event()

    async def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.queue.append(scheduler_output)
        self.max_outstanding = max(self.max_outstanding, len(self.queue))

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        await asyncio.sleep(0)  # the worker computes; the loop could do other work
        out = self.queue.popleft()
        assert out.step_id == step_id
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            assert self.num_computed[req_id] == num_computed
        req_ids, sampled = [], []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            sequence = self.tokens[req_id]
            end = self.num_computed[req_id] + num_scheduled
            assert end <= len(sequence), "scheduled past the tokens the worker holds"
            self.num_computed[req_id] = end
            req_ids.append(req_id)
            if end == len(sequence):
                # A 'greedy model': the next token follows from the sequence.
                sequence.append(100 + (sum(sequence) * 31 + len(sequence)) % 900)
                sampled.append([sequence[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=step_id, req_ids=req_ids, sampled_token_ids=sampled)

    async def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        await self.submit(scheduler_output)
        return await self.receive(scheduler_output.step_id)


async def _serve(
    async_scheduling: bool, num_micro_batches: int = 1
) -> tuple[dict[str, list[int]], set[str], int]:
    config = SchedulerConfig(
        num_kv_blocks=64,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
        num_micro_batches=num_micro_batches,
    )
    worker = InMemoryWorkerClient()
    engine = SchedulerEngine(
        config,
        worker,  # type: ignore[arg-type]
        [2],
        SchedulerMetrics("test", registry=CollectorRegistry()),
        max_waiting_requests=100,
    )
    _, queue = engine.subscribe()
    for index in range(6):
        engine.add_request(
            scheduler_pb2.AddRequestRequest(
                request_id=f"r{index}",
                prompt_token_ids=list(range(10 + index, 15 + 3 * index)),
                sampling_params=common_pb2.SamplingParams(
                    max_tokens=5 + index, ignore_eos=True, temperature=0.0
                ),
            )
        )
    stop = asyncio.Event()
    loop_task = asyncio.create_task(engine.run(stop))
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    while len(finished) < 6:
        batch = await asyncio.wait_for(queue.get(), timeout=10)
        for output in batch.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finished.add(output.request_id)
    stop.set()
    await asyncio.wait_for(loop_task, timeout=10)
    return tokens, finished, worker.max_outstanding


async def test_async_engine_keeps_one_step_ahead_and_publishes_the_same_tokens() -> None:
    sync_tokens, sync_finished, sync_depth = await _serve(async_scheduling=False)
    async_tokens, async_finished, async_depth = await _serve(async_scheduling=True)
    assert sync_depth == 1
    assert async_depth == 2  # step n+1 was sent before step n's result was read
    assert async_tokens == sync_tokens
    assert async_finished == sync_finished == {f"r{i}" for i in range(6)}
    assert {rid: len(t) for rid, t in async_tokens.items()} == {f"r{i}": 5 + i for i in range(6)}


async def test_micro_batched_engine_keeps_one_step_per_stage_in_flight() -> None:
    sync_tokens, _, _ = await _serve(async_scheduling=False)
    tokens, finished, depth = await _serve(async_scheduling=True, num_micro_batches=3)
    assert depth == 3  # three disjoint micro-batches sent before the first result was read
    assert tokens == sync_tokens
    assert finished == {f"r{i}" for i in range(6)}
