"""A request's lifecycle as one ordered enum: "is finished" is a comparison."""

from __future__ import annotations

import enum

from kvmesh.services.contracts.finish_reason import FinishReason


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished status compares above PREEMPTED."""

    WAITING = enum.auto()
    # Blocks reserved, KV being loaded from the kvstore (the KV connector);
    # back to WAITING when the worker reports the load.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI finish reason of a finished status; None while the request lives."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
