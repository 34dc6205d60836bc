"""How many distinct LoRA adapters a step may carry: never more than the worker's slots.

The worker holds ``max_loras`` adapters at once (WorkerInfo.max_loras). Every
running request may be scheduled in the next step, so admission keeps the
adapters of running plus newly admitted requests within the slots; a step,
being a subset of them, then always fits. A waiting request whose adapter
would be one too many is set aside for this step (vLLM does the same) and
requeued in its place, so requests of the base model or of adapters already
running go ahead of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.policy import RequestQueue
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.step_codec import lora_request_from_proto


def request_lora(msg: scheduler_pb2.AddRequestRequest, max_loras: int) -> LoRARequest | None:
    """The adapter an AddRequest names (None: the base model); refused when the
    worker has no slots or the message is incomplete."""
    if not msg.HasField("lora_request"):
        return None
    lora = lora_request_from_proto(msg.lora_request)
    if lora is None or not lora.lora_path:
        raise InvalidRequestError("lora_request needs lora_id and lora_path")
    if max_loras <= 0:
        raise InvalidRequestError(
            f"LoRA adapter {lora.lora_name!r} requested but the worker serves none "
            "(start it with --enable-lora)"
        )
    return lora


class AdapterAdmission:
    """The adapter count of one ``_schedule_waiting`` pass."""

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        # Without slots no request carries an adapter (refused at AddRequest):
        # skip the scan of the running requests, once per scheduling pass.
        self.active = (
            {r.lora_request.lora_id for r in running if r.lora_request is not None}
            if max_loras
            else set()
        )
        self.skipped: list[Request] = []

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        return lora is None or lora.lora_id in self.active or len(self.active) < self.max_loras

    def add(self, request: Request) -> None:
        if request.lora_request is not None:
            self.active.add(request.lora_request.lora_id)

    def skip(self, request: Request) -> None:
        self.skipped.append(request)

    def requeue_skipped(self, waiting: RequestQueue) -> None:
        """Put the set-aside requests back at the front, in their order."""
        for request in reversed(self.skipped):
            waiting.prepend(request)
        self.skipped.clear()
