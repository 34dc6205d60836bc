"""The gateway's spans: each /v1 call a server span (continuing a caller's traceparent),
tokenization under it; health and metrics routes untraced."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME
from tests.services.tracing_helpers import memory_tracing, only_span

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


async def test_a_call_is_a_server_span_in_the_callers_trace_with_tokenize_under_it(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    tracing, exporter = memory_tracing("gateway")
    app = build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry(), tracing=tracing
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
        )
    assert response.status_code == 200
    call = only_span(exporter, "POST /v1/chat/completions")
    assert format(call.context.trace_id, "032x") == CALLER_TRACE
    assert format(call.parent.span_id, "016x") == CALLER_SPAN
    assert call.attributes["http.response.status_code"] == 200
    assert only_span(exporter, "tokenize").parent.span_id == call.context.span_id
    assert {s.name for s in exporter.get_finished_spans()} == {
        "POST /v1/chat/completions",
        "tokenize",
    }
