"""The scheduler's spans of a request: under the caller's span, queue time, one event per
step, ended however the request ends; its context handed to the worker and detokenizer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.request_tracing import SchedulerRequestTraces
from kvmesh.scheduler.service import SchedulerEngine
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.runtime.tracing import Tracing
from tests.scheduler.test_scheduler_engine_async import InMemoryWorkerClient
from tests.scheduler.test_scheduler_service import _add, _run_until, abort_one_and_stop_the_other
from tests.services.tracing_helpers import memory_tracing, only_span, spans_named


class RecordingWorkerClient(InMemoryWorkerClient):
    """Also keeps the trace context each new request arrived with."""

    def __init__(self) -> None:
        super().__init__()
        self.trace_contexts: dict[str, list[dict[str, str]]] = {}

    async def receive(self, step_id: int) -> ModelRunnerOutput:
        step: SchedulerOutput = self.queue[0]
        for new in step.scheduled_new_reqs:
            self.trace_contexts.setdefault(new.req_id, []).append(new.trace_context)
        return await super().receive(step_id)


def _engine(worker: InMemoryWorkerClient, tracing: Tracing | None) -> SchedulerEngine:
    return SchedulerEngine(
        SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64),
        worker,  # type: ignore[arg-type]
        [2],
        SchedulerMetrics("test", registry=CollectorRegistry()),
        max_waiting_requests=100,
        traces=SchedulerRequestTraces(tracing) if tracing is not None else None,
    )


def _finished(rid: str):
    return lambda outputs: any(o.request_id == rid and o.finish_reason for o in outputs)


async def test_a_request_is_one_span_under_the_caller_with_its_steps_as_events() -> None:
    tracing, exporter = memory_tracing("scheduler")
    worker = RecordingWorkerClient()
    engine = _engine(worker, tracing)
    _, queue = engine.subscribe()
    with tracing.span("AddRequest") as call:
        _add(engine, "a", max_tokens=4)
    outputs = await _run_until(engine, queue, _finished("a"))

    request = only_span(exporter, "kvmesh.scheduler.request")
    queued = only_span(exporter, "scheduler.queue")
    assert request.parent.span_id == call.get_span_context().span_id
    assert queued.parent.span_id == request.context.span_id
    assert queued.end_time <= request.events[0].timestamp
    # 5 prompt tokens in one step, then one token per step: 4 steps, 4 events.
    assert [e.name for e in request.events] == ["scheduled"] * 4
    assert [e.attributes["kvmesh.num_tokens"] for e in request.events] == [5, 1, 1, 1]
    assert request.attributes["kvmesh.finish_reason"] == "length"
    assert len(engine.traces) == 0

    # Downstream services parent their spans on this one.
    header = next(o.header for o in outputs if o.HasField("header"))
    (sent,) = worker.trace_contexts["a"]
    for carrier in (dict(header.trace_context), sent):
        child = tracing.start_span("child", Tracing.parent(carrier))
        child.end()
        assert child.parent.span_id == request.context.span_id


async def test_aborted_and_stopped_requests_end_their_spans() -> None:
    tracing, exporter = memory_tracing("scheduler")
    engine = _engine(RecordingWorkerClient(), tracing)
    await abort_one_and_stop_the_other(engine)
    reasons = {
        s.attributes["kvmesh.request_id"]: s.attributes["kvmesh.finish_reason"]
        for s in spans_named(exporter, "kvmesh.scheduler.request")
    }
    assert reasons == {"long": "abort", "stopped": "stop"}
    assert len(engine.traces) == 0


async def test_untraced_requests_carry_no_context() -> None:
    worker = RecordingWorkerClient()
    engine = _engine(worker, None)
    _, queue = engine.subscribe()
    _add(engine, "a")
    outputs = await _run_until(engine, queue, _finished("a"))
    assert worker.trace_contexts["a"] == [{}]
    header = next(o.header for o in outputs if o.HasField("header"))
    assert dict(header.trace_context) == {}
    assert isinstance(header, scheduler_pb2.RequestHeader)
