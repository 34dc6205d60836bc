"""The driver's Execute loop with pipeline overlap, over a fake replica: when it
begins a step while an earlier one is unfinished, and when it finishes first.

A fake step becomes finishable (its last stage handed it back) only when the
test says so, so every order asserted here is decided by events, not timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from kvmesh.protos import worker_pb2
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.contracts.step_codec import scheduler_output_to_proto
from kvmesh.worker.server import WorkerServicer


class FakeStep:
    def __init__(self, step_id: int, req_ids: set[str]) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        self.returned = threading.Event()  # the last stage's output is back

    def wait_until_finishable(self) -> None:
        assert self.returned.wait(10)


class FakeReplica:
    """The runner and broadcaster the servicer drives: records begin/finish/reset."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.steps: dict[int, FakeStep] = {}
        self.busy: set[str] = set()

    def busy_with(self, scheduler_output: SchedulerOutput) -> bool:
        return bool(self.busy & set(scheduler_output.num_scheduled_tokens))

    def begin(self, request: worker_pb2.StepRequest, scheduler_output: SchedulerOutput):
        step = FakeStep(scheduler_output.step_id, set(scheduler_output.num_scheduled_tokens))
        self.steps[step.step_id] = step
        self.busy |= step.req_ids
        self.events.append(("begin", step.step_id))
        return step

    def finish(self, step: FakeStep) -> ModelRunnerOutput:
        step.returned.set()  # finishing receives the last stage's output
        self.busy -= step.req_ids
        self.events.append(("finish", step.step_id))
        return ModelRunnerOutput.make_empty(step.step_id)

    def reset(self) -> None:
        self.events.append(("reset", -1))

    def keep_alive(self) -> None:
        pass


def _request(step_id: int, *req_ids: str) -> worker_pb2.StepRequest:
    step = SchedulerOutput.make_empty(step_id)
    step.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    step.total_num_scheduled_tokens = len(req_ids)
    return scheduler_output_to_proto(step)


async def _until(condition, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


async def test_driver_begins_the_next_step_before_finishing_the_previous() -> None:
    replica = FakeReplica()
    servicer = WorkerServicer()
    servicer.attach(replica, worker_pb2.WorkerInfo(), replica, max_steps_begun=2)  # type: ignore[arg-type]
    requests: asyncio.Queue[worker_pb2.StepRequest | None] = asyncio.Queue()

    async def stream() -> AsyncIterator[worker_pb2.StepRequest]:
        while (request := await requests.get()) is not None:
            yield request

    # gRPC pulls results as they come: so does this task.
    answered: asyncio.Queue[int | None] = asyncio.Queue()

    async def pull() -> None:
        async for result in servicer.Execute(stream(), context=None):
            answered.put_nowait(result.step_id)
        answered.put_nowait(None)

    puller = asyncio.create_task(pull())
    # Two disjoint micro-batches: both begun, then the first finished (pipeline full).
    requests.put_nowait(_request(1, "a"))
    requests.put_nowait(_request(2, "b"))
    assert await answered.get() == 1
    assert replica.events == [("begin", 1), ("begin", 2), ("finish", 1)]
    # Nothing new arrives: step 2 is finished once its last stage hands it back.
    await asyncio.sleep(0.05)
    assert replica.events[-1] == ("finish", 1)
    replica.steps[2].returned.set()
    assert await answered.get() == 2
    # A step that runs a request of an unfinished step waits for that step's tokens.
    requests.put_nowait(_request(3, "a"))
    await _until(lambda: ("begin", 3) in replica.events)
    requests.put_nowait(_request(4, "a"))
    assert await answered.get() == 3
    await _until(lambda: ("begin", 4) in replica.events)
    assert replica.events[-3:] == [("begin", 3), ("finish", 3), ("begin", 4)]
    # The stream ends with step 4 begun: it is finished on every rank before the reset.
    requests.put_nowait(None)
    assert await answered.get() is None
    await puller
    assert replica.events[-3:] == [("begin", 4), ("finish", 4), ("reset", -1)]
