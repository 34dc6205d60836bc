"""The two sides of a step in a parallel replica: the driver broadcasts, the others follow.

The scheduler keeps talking to one Execute stream, the driver's (rank 0). The
driver forwards each ``StepRequest``'s serialized bytes to every other rank in
one ordered stream of broadcasts (worker/parallel/step_messages.py): STEP n
(begin step n), FINISH (finish the oldest begun step), each carrying the
tokens the driver sampled since its previous message. Every rank begins and
finishes steps in the driver's order, so their collectives match; with
pipeline overlap the driver begins step n+1 before it finishes step n, and
stage 1 runs step n's layers while stage 0 runs step n+1's. The other ranks
answer nothing: the driver alone returns the ``StepResult``.

A rank other than the driver receives the stream on a thread of its own,
always waiting in the next broadcast: gloo's broadcast holds the root until
every receiver has joined it, and a later stage still busy with an earlier
step must not hold the driver up.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from kvmesh.protos import worker_pb2
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.contracts.step_codec import (
    scheduler_output_from_proto,
    scheduler_output_to_proto,
)
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.step_messages import MessageKind, encode_message, parse_message
from kvmesh.worker.step_in_flight import StepInFlight

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NO_TOKENS = np.zeros(0, dtype=np.int64)


class StepBroadcaster:
    """The driver's side: what it begins and finishes, every other rank does too."""

    def __init__(self, runner: ModelRunner, collectives: Collectives) -> None:
        self.runner = runner
        self.collectives = collectives
        # Tokens of the steps finished since the last message, in finish order.
        self._sampled: list[np.ndarray] = []

    def _send(self, kind: MessageKind, payload: bytes = b"") -> None:
        message = encode_message(kind, self._sampled, payload)
        self._sampled = []
        self.collectives.broadcast_step(message)

    def begin(
        self, request: worker_pb2.StepRequest, scheduler_output: SchedulerOutput | None = None
    ) -> StepInFlight:
        """Broadcast the step, then begin the driver's part (``scheduler_output``:
        the request already decoded by the caller)."""
        self._send(MessageKind.STEP, request.SerializeToString())
        if scheduler_output is None:
            scheduler_output = scheduler_output_from_proto(request)
        return self.runner.begin_step(scheduler_output)

    def finish(self, step: StepInFlight) -> ModelRunnerOutput:
        """Finish the oldest begun step (the caller finishes them in order)."""
        self._send(MessageKind.FINISH)
        output = self.runner.finish_step(step)
        self._sampled.append(step.sampled if step.sampled is not None else _NO_TOKENS)
        return output

    def execute(
        self, request: worker_pb2.StepRequest, scheduler_output: SchedulerOutput | None = None
    ) -> ModelRunnerOutput:
        return self.finish(self.begin(request, scheduler_output))

    def reset(self) -> None:
        """Clear every rank's batch (no step may be begun and unfinished)."""
        self._send(MessageKind.RESET)
        self.runner.reset()

    def stop(self) -> None:
        self._send(MessageKind.STOP)

    def keep_alive(self) -> None:
        self._send(MessageKind.KEEPALIVE)


class BroadcastingRunner:
    """What ``kvmesh.worker.local_driver.LocalDriver`` (and benchmarks' in-process engines)
    need of a runner, over the driver's broadcast path: an in-process scheduler
    for a parallel replica (tests, benchmarks)."""

    def __init__(self, broadcaster: StepBroadcaster) -> None:
        self.broadcaster = broadcaster
        runner = broadcaster.runner
        self.cache_config = runner.cache_config
        self.model_config = runner.model_config
        self.num_kv_blocks = runner.num_kv_blocks
        self.kv_cache_groups = runner.kv_cache_groups
        self.lora_slots = runner.lora_slots

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.broadcaster.execute(scheduler_output_to_proto(step), step)

    def begin_step(self, step: SchedulerOutput) -> StepInFlight:
        return self.broadcaster.begin(scheduler_output_to_proto(step), step)

    def finish_step(self, step: StepInFlight) -> ModelRunnerOutput:
        return self.broadcaster.finish(step)

    def busy_with(self, step: SchedulerOutput) -> bool:
        return self.broadcaster.runner.busy_with(step)


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


class StepStream:
    """A follower's receiving end of the driver's stream (see the module docstring)."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self._messages: queue.SimpleQueue[bytes | BaseException] = queue.SimpleQueue()
        threading.Thread(target=self._receive, name="step-stream", daemon=True).start()

    def _receive(self) -> None:
        try:
            while True:
                message = self.collectives.broadcast_step(None)
                self._messages.put(message)
                if message[:1] == MessageKind.STOP.value:
                    return
        except BaseException as exc:  # handed to the step thread, which exits the rank
            self._messages.put(exc)

    def get(self) -> bytes:
        item = self._messages.get()
        if isinstance(item, BaseException):
            raise item
        return item


def follow_driver(runner: ModelRunner, collectives: Collectives) -> int:
    """A non-driver rank's life: begin and finish each step as the driver says,
    until it says stop; returns how many steps ran. A collective that times out
    (the driver or a peer died or hangs) raises, and the rank's process exits."""
    stream = StepStream(collectives)
    begun: deque[StepInFlight] = deque()
    awaiting_tokens: deque[StepInFlight] = deque()
    steps = 0
    while True:
        kind, sampled, payload = parse_message(stream.get())
        for tokens in sampled:
            runner.apply_sampled(awaiting_tokens.popleft(), tokens)
        if kind is MessageKind.STOP:
            logger.info("driver stopped the replica after %d steps", steps)
            return steps
        if kind is MessageKind.KEEPALIVE:
            continue
        if kind is MessageKind.RESET:
            begun.clear()
            awaiting_tokens.clear()
            runner.reset()
            continue
        if kind is MessageKind.STEP:
            step_request = worker_pb2.StepRequest.FromString(payload)
            begun.append(runner.begin_step(scheduler_output_from_proto(step_request)))
            steps += 1
            continue
        step = begun.popleft()  # FINISH
        runner.finish_step(step)
        awaiting_tokens.append(step)
