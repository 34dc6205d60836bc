"""The two sides of one step in a parallel replica: the driver broadcasts, the others follow.

The scheduler keeps talking to one Execute stream, the driver's (rank 0). The
driver forwards each ``StepRequest``'s serialized bytes to every other rank in
one broadcast (two gloo collectives: length, bytes), then all ranks decode it
and run the same step. The other ranks answer nothing: the driver alone
returns the ``StepResult``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from protos import worker_pb2
from services.step import ModelRunnerOutput, SchedulerOutput
from services.step_codec import scheduler_output_from_proto, scheduler_output_to_proto
from worker.model_runner import ModelRunner
from worker.parallel.collectives import Collectives
from worker.parallel.step_messages import (
    KEEPALIVE,
    RESET,
    STOP,
    MessageKind,
    parse_message,
    step_message,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StepBroadcaster:
    """The driver's side: what it runs, every other rank runs too."""

    def __init__(self, runner: ModelRunner, collectives: Collectives) -> None:
        self.runner = runner
        self.collectives = collectives

    def execute(
        self, request: worker_pb2.StepRequest, scheduler_output: SchedulerOutput | None = None
    ) -> ModelRunnerOutput:
        """Broadcast the step, then run the driver's part (``scheduler_output``: the
        request already decoded by the caller)."""
        self.collectives.broadcast_step(step_message(request.SerializeToString()))
        if scheduler_output is None:
            scheduler_output = scheduler_output_from_proto(request)
        return self.runner.execute_model(scheduler_output)

    def reset(self) -> None:
        self.collectives.broadcast_step(RESET)
        self.runner.reset()

    def stop(self) -> None:
        self.collectives.broadcast_step(STOP)

    def keep_alive(self) -> None:
        self.collectives.broadcast_step(KEEPALIVE)


class BroadcastingRunner:
    """What ``worker.local_driver.LocalDriver`` needs of a runner, over the driver's
    broadcast path: an in-process scheduler for a parallel replica (tests, benchmarks)."""

    def __init__(self, broadcaster: StepBroadcaster) -> None:
        self.broadcaster = broadcaster
        self.cache_config = broadcaster.runner.cache_config
        self.num_kv_blocks = broadcaster.runner.num_kv_blocks

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.broadcaster.execute(scheduler_output_to_proto(step), step)


def lead_or_follow(
    runner: ModelRunner,
    collectives: Collectives,
    lead: Callable[[BroadcastingRunner], T],
) -> T | None:
    """An in-process replica's rank: the driver runs ``lead`` over the broadcast path
    (a keep-alive first, as an idle driver sends) and then stops the others, which
    follow until then. Returns what ``lead`` returned, on the driver."""
    if not collectives.layout.is_driver:
        follow_driver(runner, collectives)
        return None
    broadcaster = StepBroadcaster(runner, collectives)
    try:
        broadcaster.keep_alive()
        return lead(BroadcastingRunner(broadcaster))
    finally:
        broadcaster.stop()


def follow_driver(runner: ModelRunner, collectives: Collectives) -> int:
    """A non-driver rank's life: run each step the driver broadcasts until it
    says stop; returns how many steps ran. A collective that times out (the
    driver or a peer died or hangs) raises, and the rank's process exits."""
    steps = 0
    while True:
        kind, payload = parse_message(collectives.broadcast_step(None))
        if kind is MessageKind.STOP:
            logger.info("driver stopped the replica after %d steps", steps)
            return steps
        if kind is MessageKind.KEEPALIVE:
            continue
        if kind is MessageKind.RESET:
            runner.reset()
            continue
        runner.execute_model(
            scheduler_output_from_proto(worker_pb2.StepRequest.FromString(payload))
        )
        steps += 1
