"""services/runtime/tracing.py: off costs no SDK import; on, contexts round-trip and spans close."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from kvmesh.services.runtime.tracing import (
    MAX_STEP_EVENTS,
    RequestSpans,
    Tracing,
    span_or_nothing,
    start_tracing,
)
from tests.deploy.deploy_facts import REPO_ROOT
from tests.services.tracing_helpers import memory_tracing, only_span, spans_named

_SDK_PARTS = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation")


def test_tracing_off_loads_neither_sdk_nor_exporter_nor_instrumentation() -> None:
    # A fresh interpreter: this test process has loaded the SDK already.
    probe = f"""
import sys
import kvmesh.gateway.server, kvmesh.scheduler.server
import kvmesh.worker.server, kvmesh.detokenizer.server
from kvmesh.services.runtime.tracing import span_or_nothing, start_tracing
assert start_tracing("gateway", "") is None
with span_or_nothing(None, "tokenize"):
    pass
loaded = sorted(m for m in sys.modules if m.startswith({_SDK_PARTS!r}))
print(loaded)
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tracing_on_names_its_service() -> None:
    tracing = start_tracing("scheduler", "http://127.0.0.1:1")
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == "kvmesh-scheduler"
    finally:
        tracing.shutdown()


def test_a_carried_context_parents_the_span_downstream() -> None:
    tracing, exporter = memory_tracing()
    with tracing.span("upstream") as upstream:
        carrier = Tracing.carrier(upstream)
    assert set(carrier) >= {"traceparent"}
    tracing.start_span("downstream", Tracing.parent(carrier)).end()
    up, down = only_span(exporter, "upstream"), only_span(exporter, "downstream")
    assert down.context.trace_id == up.context.trace_id
    assert down.parent.span_id == up.context.span_id


def test_an_unsampled_span_carries_nothing() -> None:
    tracing = Tracing(TracerProvider(sampler=ALWAYS_OFF))
    span = tracing.start_span("dropped")
    assert Tracing.carrier(span) == {}
    span.end()


def test_request_spans_end_once_and_all_at_once() -> None:
    tracing, exporter = memory_tracing()
    spans = RequestSpans(tracing, "request")
    spans.start("a", None)
    spans.start("b", None)
    spans.start("a", None)  # again: the first "a" ends
    assert len(spans) == 2
    spans.end("a", {"kvmesh.finish_reason": "stop"})
    spans.end("a")  # no-op
    spans.end("never-started")  # no-op
    spans.end_all("stream lost")
    ended = spans_named(exporter, "request")
    assert len(spans) == 0
    assert [s.attributes["kvmesh.request_id"] for s in ended] == ["a", "a", "b"]
    assert ended[1].attributes["kvmesh.finish_reason"] == "stop"
    assert ended[2].attributes["kvmesh.ended_by"] == "stream lost"


def test_span_or_nothing_is_a_child_span_when_on() -> None:
    tracing, exporter = memory_tracing()
    with tracing.span("call"), span_or_nothing(tracing, "tokenize"):
        pass
    assert (
        only_span(exporter, "tokenize").parent.span_id
        == only_span(exporter, "call").context.span_id
    )


def test_steps_become_events_at_the_end_first_and_last_kept_past_the_limit() -> None:
    tracing, exporter = memory_tracing()
    spans = RequestSpans(tracing, "request", step_event="scheduled")
    spans.start("r", None)
    num_steps = MAX_STEP_EVENTS + 72
    for step_id in range(num_steps):
        assert spans.record_step("r", {"kvmesh.step_id": step_id})
    assert not spans.record_step("untraced", {"kvmesh.step_id": 0})
    assert exporter.get_finished_spans() == ()  # nothing exported while it runs
    spans.end("r")
    span = only_span(exporter, "request")
    kept = [e.attributes["kvmesh.step_id"] for e in span.events]
    half = MAX_STEP_EVENTS // 2
    assert kept == [*range(half), *range(num_steps - half, num_steps)]
    assert {e.name for e in span.events} == {"scheduled"}
    assert [e.timestamp for e in span.events] == sorted(e.timestamp for e in span.events)
    assert span.attributes["kvmesh.num_steps"] == num_steps
