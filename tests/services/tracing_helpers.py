"""In-memory span capture for the tracing tests: a Tracing whose spans land in a list."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.services.runtime.tracing import Tracing


def memory_tracing(service: str = "test") -> tuple[Tracing, InMemorySpanExporter]:
    """A Tracing exporting each span as it ends into the returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": f"kvmesh-{service}"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def only_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (span,) = spans_named(exporter, name)
    return span
