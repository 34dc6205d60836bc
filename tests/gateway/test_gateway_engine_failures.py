"""Engine refusals and failures become OpenAI error bodies with the right status, never a hang."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.services.contracts.errors import KvmeshError, OverloadedError, UnavailableError
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import parse_sse

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION_BODY = {"prompt": "Once upon a time there was", "max_tokens": 8}


@pytest.mark.parametrize(
    ("error_class", "status", "error_type"),
    [
        (UnavailableError, 503, "service_unavailable_error"),
        (OverloadedError, 429, "rate_limit_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [("/v1/completions", COMPLETION_BODY), ("/v1/chat/completions", CHAT_BODY)],
)
async def test_refused_admission_keeps_its_status(
    client: httpx.AsyncClient,
    engine: FakeEngineClient,
    error_class: type[KvmeshError],
    status: int,
    error_type: str,
    stream: bool,
    endpoint: str,
    body: dict,
) -> None:
    engine.fail_with = error_class("scheduler queue is full")
    response = await client.post(endpoint, json={**body, "stream": stream, "n": 2})
    # Streams wait for admission, so even they answer with the real status.
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["message"] == "scheduler queue is full"
    # A 429 says when to come back.
    assert response.headers.get("retry-after") == ("1" if status == 429 else None)


async def test_refusal_of_one_sibling_aborts_the_others(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_with = UnavailableError("engine unavailable")
    response = await client.post("/v1/completions", json={**COMPLETION_BODY, "n": 3})
    assert response.status_code == 503
    assert len(engine.aborted) == 3


async def test_failure_mid_generation_non_streaming_is_503(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_after_deltas = 2
    response = await client.post("/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "worker died"


async def test_failure_mid_stream_sends_an_error_event_then_done(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_after_deltas = 3
    response = await client.post("/v1/completions", json={**COMPLETION_BODY, "stream": True})
    assert response.status_code == 200  # headers were already sent
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "worker died",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
    }
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert len(texts) == 3


async def test_unexpected_engine_exception_is_a_logged_500_with_openai_body(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_with = RuntimeError("bug in the client")
    response = await client.post("/v1/completions", json=COMPLETION_BODY)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error"
    assert "bug in the client" not in response.text  # internals stay in the log


async def test_readiness_follows_the_engine(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    assert (await client.get("/ready")).status_code == 200
    engine.ready = False
    response = await client.get("/ready")
    assert response.status_code == 503
    assert "worker unreachable" in response.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 200  # liveness is unaffected
