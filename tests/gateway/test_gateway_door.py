"""A full gate answers 429 from the HTTP protocol object (gateway/openai/door.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.gateway.admission import AdmissionGate
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.door import door_protocol
from kvmesh.gateway.openai.errors import error_body
from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()


class _CountingApp:
    """Counts the calls that reached the ASGI app at all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


@asynccontextmanager
async def _serving(app: ASGIApp, gate: AdmissionGate, api_key: str | None) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        http=door_protocol(gate, api_key),
        log_level="warning",
        lifespan="off",
        # A failed test must not hang on a call still in flight.
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


def _request(path: str, body: bytes, headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status_line, *lines = head.strip().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return (
        int(status_line.split()[1]),
        headers,
        await reader.readexactly(int(headers["content-length"])),
    )


def _door_refusals_timed() -> float:
    return REGISTRY.get_sample_value("kvmesh_gateway_door_refusal_seconds_count") or 0.0


async def test_a_full_gate_answers_429_without_the_app_and_keeps_the_connection(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    gate = AdmissionGate(1)
    app = _CountingApp(
        build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), admission=gate)
    )
    async with _serving(app, gate, None) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert gate.try_enter()  # the one slot is taken
        timed_before = _door_refusals_timed()
        writer.write(_request("/v1/completions", BODY))
        status, headers, body = await _answer(reader)
        assert status == 429
        assert headers["retry-after"] == "1"
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == error_body(gate.refusal())
        assert app.calls == 0 and engine.requests == [] and gate.refused == 1
        assert _door_refusals_timed() == timed_before + 1
        # Ungated routes still reach the app while the gate is full.
        writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert (await _answer(reader))[0] == 200
        assert app.calls == 1
        # The refused call's body was skipped, not taken for the next request:
        # once the slot is free, the same connection gets a completion.
        gate.leave()
        writer.write(_request("/v1/completions", BODY))
        status, _, body = await _answer(reader)
        assert status == 200, body
        assert json.loads(body)["object"] == "text_completion"
        await _until(lambda: gate.in_use == 0)  # the door's slot is back once the call ends
        assert gate.refused == 1
        writer.close()


async def test_the_door_takes_the_slot_before_any_task_runs(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    """A burst: requests parsed back to back, before the first one's task starts."""
    gate = AdmissionGate(1)
    app = _CountingApp(
        build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), admission=gate)
    )
    engine.hang_after_deltas = 1
    async with _serving(app, gate, None) as port:
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for _, writer in connections:
            writer.write(_request("/v1/completions", BODY))
        await engine.hanging.wait()
        answers = [await _answer(reader) for reader, _ in connections[1:]]
        # The first took the slot at its headers; the others never reached the
        # app (a door that only looked at the count let all three in, and the
        # middleware refused two of them from their tasks).
        assert [status for status, _, _ in answers] == [429, 429]
        assert app.calls == 1 and len(engine.requests) == 1 and gate.refused == 2
        for _, writer in connections:
            writer.close()
        await _until(lambda: gate.in_use == 0)  # the hanging call's client left


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_the_door_closes_a_connection_the_client_asked_to_close(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    gate = AdmissionGate(1)
    app = build_app(engine, tokenizer, MODEL_NAME, CollectorRegistry(), admission=gate)
    async with _serving(app, gate, None) as port:
        assert gate.try_enter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request("/v1/chat/completions", BODY, "Connection: close\r\n"))
        status, headers, _ = await _answer(reader)
        assert (status, headers["connection"]) == (429, "close")
        assert await reader.read() == b""  # closed by the server
        writer.close()


async def test_a_call_without_the_api_key_gets_its_401_even_when_full(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    gate = AdmissionGate(1)
    app = build_app(
        engine, tokenizer, MODEL_NAME, CollectorRegistry(), admission=gate, api_key="secret"
    )
    async with _serving(app, gate, "secret") as port:
        assert gate.try_enter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request("/v1/completions", BODY, "Authorization: Bearer wrong\r\n"))
        assert (await _answer(reader))[0] == 401
        writer.write(_request("/v1/completions", BODY, "Authorization: Bearer secret\r\n"))
        assert (await _answer(reader))[0] == 429
        assert gate.refused == 1
        writer.close()
