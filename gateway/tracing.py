"""The gateway's part of each request's trace (services/runtime/tracing.py).

- ``HttpTracingMiddleware``: one server span per ``/v1`` HTTP call, the root of
  the request's trace, or the child of the caller's span when the call
  carries a W3C ``traceparent`` header (as vLLM continues a client's trace).
- ``tokenize`` (chat template and tokenizer): a child span of the call.
- ``start_engine_span``: one ``gateway.generate`` span per engine request
  (one per choice), from submission to the last delta, with an event at the
  first token; the AddRequest call under it carries the context on to the
  scheduler (its client span and metadata come from the gRPC
  instrumentation, on the scheduler channel).
The public gRPC API's Generate gets its server span from the same
instrumentation, on the public port.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.gateway.engine.client import GenerationDelta
from kvmesh.services.runtime.tracing import Tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# Calls to the scheduler that carry one request each (client spans).
TRACED_SCHEDULER_METHODS = ("AddRequest", "Prefill")
# Calls of the public gRPC API that carry a generation (server spans).
TRACED_PUBLIC_METHODS = ("Generate",)


class HttpTracingMiddleware:
    """A server span around each ``/v1`` call (health, metrics and docs stay untraced)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        name = f"{scope['method']} {scope['path']}"
        with self.tracing.tracer.start_as_current_span(
            name, context=Tracing.parent(headers), kind=SpanKind.SERVER
        ) as span:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_noting_status)


def start_engine_span(tracing: Tracing | None, request_id: str) -> Span | None:
    """``gateway.generate`` for one engine request (``None`` when off); the caller ends it.

    Started, not made current: the caller is an async generator, and a
    context attached across its ``yield`` would leak into its consumer.
    :func:`current` makes it current around the calls that send it on.
    """
    if tracing is None:
        return None
    return tracing.start_span("gateway.generate", None, {"kvmesh.request_id": request_id})


def current(span: Span | None) -> AbstractContextManager[Any]:
    return nullcontext() if span is None else Tracing.current(span)


def note_delta(span: Span | None, delta: GenerationDelta) -> None:
    """The first tokens as an event; how it ended as attributes."""
    if span is None:
        return
    if delta.token_ids and delta.num_output_tokens == len(delta.token_ids):
        span.add_event("first_token", {"kvmesh.num_cached_tokens": delta.num_cached_tokens})
    if delta.finished:
        span.set_attributes(
            {
                "kvmesh.finish_reason": delta.finish_reason or "",
                "kvmesh.num_output_tokens": delta.num_output_tokens,
            }
        )
