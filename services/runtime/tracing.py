"""OpenTelemetry traces across the services: one trace per request, off by default.

With ``--otlp-traces-endpoint`` every service builds a :class:`Tracing` (an
SDK tracer provider exporting over OTLP/gRPC) and every request becomes one
trace: gateway (HTTP, tokenize, route, generate) → scheduler (AddRequest,
the request's life with its queue time and one event per scheduled step) →
worker (the request's residency in the batch, one event per step) →
detokenizer. Without the flag, :func:`start_tracing` returns ``None`` and
nothing imports OpenTelemetry: every call site checks for ``None`` first, so
tracing off costs one comparison per step, not per request.

How the context travels (docs/design/tracing.md):

- calls that carry one request (AddRequest, Prefill, the public Generate)
  carry it in gRPC metadata, written and read by
  ``opentelemetry-instrumentation-grpc``'s interceptors;
- streams that carry many requests (the scheduler → worker step stream, the
  scheduler → detokenizer output stream) carry each request's context once,
  inside the message that introduces the request (``NewRequest`` and
  ``RequestHeader``'s ``trace_context``), written and read by the same
  propagator (``opentelemetry.propagate``, W3C trace context by default).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

# A request's trace context as text fields (W3C ``traceparent``, ``tracestate``).
TraceCarrier = dict[str, str]
# Attribute values OpenTelemetry accepts.
Attributes = Mapping[str, str | int | float | bool]


class Tracing:
    """One service's tracer and gRPC interceptors (built only when tracing is on)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("kvmesh")

    def server_interceptor(self, methods: Collection[str]) -> grpc.aio.ServerInterceptor:
        """A server span per call of ``methods`` (names without service), parented by
        the caller's metadata. Other methods (streams, health) stay untraced."""
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        only = filters.any_of(*(filters.method_name(m) for m in methods))
        return aio_server_interceptor(self.provider, filter_=only)

    def client_interceptors(self, methods: Collection[str]) -> list[grpc.aio.ClientInterceptor]:
        """A client span per call of ``methods``, its context sent in the metadata."""
        from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

        only = filters.any_of(*(filters.method_name(m) for m in methods))
        return aio_client_interceptors(self.provider, filter_=only)

    def span(self, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Span]:
        """A child of the current span, current itself while the block runs."""
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def start_span(
        self, name: str, parent: Context | None = None, attributes: Attributes | None = None
    ) -> Span:
        """A span that outlives the block that starts it (``parent``: the current context)."""
        return self.tracer.start_span(name, context=parent, attributes=attributes)

    @staticmethod
    def carrier(span: Span) -> TraceCarrier:
        """``span``'s context as text fields; empty when the span is not sampled, so
        the services downstream open no spans for it."""
        from opentelemetry import propagate, trace

        carrier: TraceCarrier = {}
        if span.is_recording():
            propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def parent(carrier: Mapping[str, str]) -> Context:
        """The context a :meth:`carrier` came from, to parent spans downstream."""
        from opentelemetry import propagate

        return propagate.extract(carrier)

    @staticmethod
    @contextmanager
    def current(span: Span) -> Iterator[None]:
        """Make ``span`` current for a block (no ``yield`` of a generator inside it)."""
        from opentelemetry import trace

        with trace.use_span(span, end_on_exit=False):
            yield

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()


def start_tracing(service: str, endpoint: str) -> Tracing | None:
    """``service``'s tracing to the OTLP/gRPC collector at ``endpoint``; ``None`` when empty.

    Spans go out in batches from a background thread. Sampling follows the
    SDK's standard variables (``OTEL_TRACES_SAMPLER``, e.g.
    ``parentbased_traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG=0.1``); the
    services downstream of the gateway follow its decision.
    """
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"kvmesh-{service}"}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)


def span_or_nothing(
    tracing: Tracing | None, name: str, attributes: Attributes | None = None
) -> AbstractContextManager[Any]:
    """``tracing.span(name)``, or nothing at all when tracing is off."""
    return nullcontext() if tracing is None else tracing.span(name, attributes)


# Step events kept per span: the first half (queueing, prefill chunks, first
# tokens) and the last half (how it ended). A request runs one step per
# generated token, and each event costs the SDK tens of microseconds (29 us
# measured on the shared 2-core dev box) when the span ends, on the loop or
# thread that ends it; kvmesh.num_steps counts them all.
MAX_STEP_EVENTS = 32


@dataclass
class _OpenRequest:
    span: Span
    # (time in ns, attributes) of each step, turned into events when the span ends.
    steps: list[tuple[int, Attributes]] = field(default_factory=list)


class RequestSpans:
    """One open span per request, for a service that sees each request over many steps.

    Started when the request arrives (from the context it carries), given one
    event per step it takes, ended when it leaves. A step costs a tuple
    appended to a list (1.7 us per request, against 29 us for an SDK event, on
    the shared 2-core dev box); the events are made when the span ends, at
    most ``MAX_STEP_EVENTS`` of them, the first and the last steps. Only
    traced requests are here, and tracing off means no RequestSpans at all.
    """

    def __init__(self, tracing: Tracing, name: str, step_event: str = "step") -> None:
        self.tracing = tracing
        self.name = name
        self.step_event = step_event
        self._open: dict[str, _OpenRequest] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def start(
        self, request_id: str, parent: Context | None, attributes: Attributes | None = None
    ) -> Span:
        """Open the request's span (ending one still open under the same id)."""
        self.end(request_id)
        span = self.tracing.start_span(
            self.name, parent, {"kvmesh.request_id": request_id, **(attributes or {})}
        )
        self._open[request_id] = _OpenRequest(span)
        return span

    def get(self, request_id: str) -> Span | None:
        request = self._open.get(request_id)
        return None if request is None else request.span

    def record_step(self, request_id: str, attributes: Attributes) -> bool:
        """Note a step of the request now; False when it is not traced here."""
        request = self._open.get(request_id)
        if request is None:
            return False
        request.steps.append((time.time_ns(), attributes))
        return True

    def end(self, request_id: str, attributes: Attributes | None = None) -> None:
        """End the request's span, if it has one open (a no-op otherwise)."""
        request = self._open.pop(request_id, None)
        if request is None:
            return
        span, steps = request.span, request.steps
        kept = steps
        if len(steps) > MAX_STEP_EVENTS:
            half = MAX_STEP_EVENTS // 2
            kept = steps[:half] + steps[-half:]
        for timestamp, step in kept:
            span.add_event(self.step_event, step, timestamp)
        span.set_attributes({"kvmesh.num_steps": len(steps), **(attributes or {})})
        span.end()

    def end_all(self, reason: str) -> None:
        """End every open span: the requests left all at once (a stream broke)."""
        for request_id in list(self._open):
            self.end(request_id, {"kvmesh.ended_by": reason})
