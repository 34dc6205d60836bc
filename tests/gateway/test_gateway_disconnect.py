"""A client that goes away (or a cancelled handler) aborts its engine requests.

These drive the ASGI app by hand so the test controls exactly when the
client's ``http.disconnect`` arrives: after the engine has started generating
and then stalls, as a long generation would.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "ignore_eos": True}


def _scope(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {
        "type": "http",
        # 2.3 is what uvicorn announces; Starlette then watches for disconnects itself.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"gateway"),
            (b"content-type", b"application/json"),
            *(headers or []),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("gateway", 80),
    }


async def _call(
    app: FastAPI,
    path: str,
    body: dict,
    disconnect: asyncio.Event,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> list[dict]:
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_scope(path, headers), receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_disconnect_during_stream_aborts_every_choice(
    app: FastAPI, engine: FakeEngineClient, path: str
) -> None:
    engine.hang_after_deltas = 3
    body = {**CHAT_BODY, "n": 2, "stream": True}
    if path == "/v1/completions":
        body = {"prompt": "Once upon a time", "max_tokens": 50, "n": 2, "stream": True}
    sent = await _call(app, path, body, disconnect=engine.hanging)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    streamed = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert streamed.startswith(b"data: ")
    assert b"[DONE]" not in streamed
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)
    assert len(engine.aborted) == 2


async def test_disconnect_while_waiting_for_a_whole_response_aborts(
    app: FastAPI, engine: FakeEngineClient
) -> None:
    engine.hang_after_deltas = 2
    await _call(app, "/v1/chat/completions", {**CHAT_BODY, "n": 3}, disconnect=engine.hanging)
    assert len(engine.requests) == 3
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)


async def test_cancelled_handler_aborts_its_requests(
    app: FastAPI, engine: FakeEngineClient
) -> None:
    engine.hang_after_deltas = 1
    never = asyncio.Event()
    call = asyncio.create_task(_call(app, "/v1/chat/completions", CHAT_BODY, disconnect=never))
    await asyncio.wait_for(engine.hanging.wait(), timeout=5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine.aborted == [engine.requests[0].request_id]


async def test_finished_requests_are_not_aborted(app: FastAPI, engine: FakeEngineClient) -> None:
    never = asyncio.Event()
    body = {**CHAT_BODY, "max_tokens": 3, "stream": True}
    sent = await _call(app, "/v1/chat/completions", body, disconnect=never)
    assert b"[DONE]" in b"".join(m.get("body", b"") for m in sent)
    assert engine.aborted == []


async def test_disconnect_aborts_behind_the_api_key_check(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    # The key check is plain ASGI middleware; Starlette's BaseHTTPMiddleware
    # would hide the disconnect from the stream and leak the engine requests.
    app = build_app(engine, tokenizer, "m", metrics_registry=CollectorRegistry(), api_key="k")
    engine.hang_after_deltas = 2
    body = {**CHAT_BODY, "model": "m", "n": 2, "stream": True}
    sent = await _call(
        app, "/v1/chat/completions", body, engine.hanging, [(b"authorization", b"Bearer k")]
    )
    assert sent[0]["status"] == 200
    assert len(engine.aborted) == 2
