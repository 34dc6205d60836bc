"""The scheduler's part of each request's trace (services/runtime/tracing.py).

Per traced request: a ``kvmesh.scheduler.request`` span from admission to the end,
child of the AddRequest server span (so of the gateway's spans), with a
``scheduler.queue`` child for the time until it is first scheduled and one
``scheduled`` event per step that advances it (step id, tokens). Events,
not spans, for the steps, and noted cheaply until the span ends
(services/runtime/tracing.py, ``RequestSpans``): a request runs hundreds of steps.

The request's span context goes downstream with the request itself: in its
``RequestHeader`` (to the detokenizer) and in each ``NewRequestData`` that
sends it to the worker (first admission, and again after a preemption).
"""

from __future__ import annotations

from kvmesh.protos import scheduler_pb2
from kvmesh.services.contracts.step import SchedulerOutput
from kvmesh.services.runtime.tracing import RequestSpans, Tracing


class SchedulerRequestTraces:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self._requests = RequestSpans(tracing, "kvmesh.scheduler.request", step_event="scheduled")
        self._queued = RequestSpans(tracing, "scheduler.queue")

    def __len__(self) -> int:
        return len(self._requests)

    def on_added(
        self, msg: scheduler_pb2.AddRequestRequest, header: scheduler_pb2.RequestHeader | None
    ) -> None:
        """Open the request's spans under the current context (the AddRequest call's)."""
        rid = msg.request_id
        span = self._requests.start(
            rid, None, {"kvmesh.num_prompt_tokens": len(msg.prompt_token_ids)}
        )
        with Tracing.current(span):
            self._queued.start(rid, None)
        if header is not None:
            header.trace_context.update(Tracing.carrier(span))

    def on_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """One event per traced request in the step; hand new ones their context."""
        if not self._requests:
            return
        for new in scheduler_output.scheduled_new_reqs:
            span = self._requests.get(new.req_id)
            if span is not None:
                new.trace_context = Tracing.carrier(span)
        step_id = scheduler_output.step_id
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if rid in self._requests:
                self._queued.end(rid)  # its first step: the wait is over
                step = {"kvmesh.step_id": step_id, "kvmesh.num_tokens": num_tokens}
                self._requests.record_step(rid, step)

    def on_finished(self, request_id: str, reason: str, num_cached_tokens: int = 0) -> None:
        """End the request's spans (a no-op for an untraced or already ended one)."""
        self._queued.end(request_id)
        attributes = {"kvmesh.finish_reason": reason, "kvmesh.num_cached_tokens": num_cached_tokens}
        self._requests.end(request_id, attributes)
