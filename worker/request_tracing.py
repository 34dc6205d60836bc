"""The worker's part of each request's trace (services/runtime/tracing.py).

The step stream is one long call carrying every request, so a request's
context arrives in its ``NewRequestData.trace_context``. Per traced request
the worker keeps one ``worker.request`` span, child of the scheduler's span
of the request, open while the request is in the persistent batch (a
preempted request that comes back opens a second one), with one ``step``
event per step that computed its tokens (tokens, batch size, step time).
Runs on the step thread, after the step: the forward pass never waits on it.
The end of the stream is seen on the event loop, possibly while a cancelled
step still runs: a lock keeps the two apart.
"""

from __future__ import annotations

import threading

from kvmesh.services.contracts.step import SchedulerOutput
from kvmesh.services.runtime.tracing import RequestSpans, Tracing


class WorkerRequestTraces:
    def __init__(self, tracing: Tracing) -> None:
        self._spans = RequestSpans(tracing, "worker.request")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._spans)

    def on_step(self, scheduler_output: SchedulerOutput, step_seconds: float) -> None:
        with self._lock:
            self._record_step(scheduler_output, step_seconds)

    def _record_step(self, scheduler_output: SchedulerOutput, step_seconds: float) -> None:
        # Dropped before the step ran: finished, aborted or preempted.
        for rid in scheduler_output.finished_req_ids:
            self._spans.end(rid)
        for new in scheduler_output.scheduled_new_reqs:
            if new.trace_context:
                self._spans.start(
                    new.req_id,
                    Tracing.parent(new.trace_context),
                    {"kvmesh.num_computed_tokens": new.num_computed_tokens},
                )
        if not self._spans:
            return
        attributes = {
            "kvmesh.step_id": scheduler_output.step_id,
            "kvmesh.batch_size": len(scheduler_output.num_scheduled_tokens),
            "kvmesh.step_seconds": step_seconds,
        }
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if rid in self._spans:
                self._spans.record_step(rid, {**attributes, "kvmesh.num_tokens": num_tokens})

    def on_detached(self) -> None:
        """The scheduler's stream ended: the batch, and every request in it, is gone."""
        with self._lock:
            self._spans.end_all("scheduler detached")
