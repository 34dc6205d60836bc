"""The worker's span of a traced request: under the scheduler's span, one event per step,
ended when the request leaves the batch or the scheduler detaches."""

from __future__ import annotations

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import CachedRequestData, NewRequestData, SchedulerOutput
from kvmesh.services.runtime.tracing import Tracing
from kvmesh.worker.request_tracing import WorkerRequestTraces
from tests.services.tracing_helpers import memory_tracing, only_span, spans_named


def _step(
    step_id: int,
    new: list[NewRequestData] = (),
    scheduled: dict[str, int] | None = None,
    finished: set[str] = frozenset(),
) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
    )


def _new(rid: str, trace_context: dict[str, str]) -> NewRequestData:
    return NewRequestData(rid, [1, 2, 3], [], SamplingParams(), [0], 0, trace_context=trace_context)


def test_a_traced_request_spans_its_stay_in_the_batch() -> None:
    tracing, exporter = memory_tracing("worker")
    traces = WorkerRequestTraces(tracing)
    with tracing.span("kvmesh.scheduler.request") as upstream:
        carrier = Tracing.carrier(upstream)
    traces.on_step(_step(1, [_new("t", carrier), _new("u", {})], {"t": 3, "u": 3}), 0.02)
    traces.on_step(_step(2, scheduled={"t": 1, "u": 1}), 0.01)
    assert len(traces) == 1  # the untraced request has no span
    traces.on_step(_step(3, finished={"t"}, scheduled={"u": 1}), 0.01)
    span = only_span(exporter, "worker.request")
    assert span.parent.span_id == upstream.get_span_context().span_id
    assert [e.attributes["kvmesh.num_tokens"] for e in span.events] == [3, 1]
    assert [e.attributes["kvmesh.step_id"] for e in span.events] == [1, 2]
    assert span.events[0].attributes["kvmesh.batch_size"] == 2
    assert len(traces) == 0


def test_a_detaching_scheduler_ends_every_span() -> None:
    tracing, exporter = memory_tracing("worker")
    traces = WorkerRequestTraces(tracing)
    with tracing.span("kvmesh.scheduler.request") as upstream:
        carrier = Tracing.carrier(upstream)
    traces.on_step(_step(1, [_new("a", carrier), _new("b", carrier)], {"a": 3, "b": 3}), 0.02)
    traces.on_detached()
    assert len(spans_named(exporter, "worker.request")) == 2
    assert len(traces) == 0
