"""A tiny OpenAI-style streaming completions server with known timing, on a loopback port.

Each request streams ``max_tokens`` token events (or ``num_chunks`` when set):
the first after ``first_delay_s``, the others ``chunk_delay_s`` apart, then a
usage event when asked for, then ``[DONE]``. It counts requests and the most
that were ever in flight, so tests can check what a load generator did.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL_ID = "fake-model"
PROMPT_TOKENS = 7  # what the usage event reports, whatever the prompt


@dataclass
class Behaviour:
    first_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    num_chunks: int | None = None  # None: one event per requested token
    send_usage: bool = True
    http_status: int = 200
    error_after_chunks: int | None = None  # send an error event after this many tokens


@dataclass
class Observed:
    num_requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def _event(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def build_app(behaviour: Behaviour, observed: Observed) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        """One (zero) vector per input after ``first_delay_s``; usage counts list inputs' ids."""
        payload = await request.json()
        observed.num_requests += 1
        observed.payloads.append(payload)
        observed.headers.append(dict(request.headers))
        if behaviour.http_status != 200:
            return JSONResponse(
                {"error": {"message": "refused"}}, status_code=behaviour.http_status
            )
        observed.in_flight += 1
        observed.max_in_flight = max(observed.max_in_flight, observed.in_flight)
        try:
            await asyncio.sleep(behaviour.first_delay_s)
        finally:
            observed.in_flight -= 1
        inputs = payload["input"]
        tokens = sum(len(i) if isinstance(i, list) else PROMPT_TOKENS for i in inputs)
        data = [
            {"object": "embedding", "index": i, "embedding": "AAAAAA=="} for i in range(len(inputs))
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": MODEL_ID, "usage": usage})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        payload = await request.json()
        observed.num_requests += 1
        observed.payloads.append(payload)
        observed.headers.append(dict(request.headers))
        if behaviour.http_status != 200:
            return JSONResponse(
                {"error": {"message": "refused"}}, status_code=behaviour.http_status
            )
        num_chunks = behaviour.num_chunks or payload["max_tokens"]
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))

        async def stream() -> AsyncIterator[str]:
            observed.in_flight += 1
            observed.max_in_flight = max(observed.max_in_flight, observed.in_flight)
            try:
                yield ": ping\n\n"  # an SSE comment, which clients must skip
                for index in range(num_chunks):
                    if behaviour.error_after_chunks == index:
                        yield _event({"error": {"message": "engine died", "code": 503}})
                        return
                    await asyncio.sleep(
                        behaviour.first_delay_s if index == 0 else behaviour.chunk_delay_s
                    )
                    finish = "length" if index == num_chunks - 1 else None
                    choice = {"index": 0, "text": f"t{index} ", "finish_reason": finish}
                    yield _event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
                if include_usage and behaviour.send_usage:
                    usage = {
                        "prompt_tokens": PROMPT_TOKENS,
                        "completion_tokens": num_chunks,
                        "total_tokens": PROMPT_TOKENS + num_chunks,
                    }
                    yield _event({"id": "cmpl-1", "choices": [], "usage": usage})
                yield _event("[DONE]")
            finally:
                observed.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeOpenAIServer:
    """Runs the app with uvicorn in a background thread; ``reset()`` between tests."""

    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.observed = Observed()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = build_app(self.behaviour, self.observed)
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def reset(self, **behaviour: Any) -> None:
        # Mutate in place: the running app holds these very objects.
        fresh = Behaviour(**behaviour)
        for name in Behaviour.__dataclass_fields__:
            setattr(self.behaviour, name, getattr(fresh, name))
        fresh_observed = Observed()
        for name in Observed.__dataclass_fields__:
            setattr(self.observed, name, getattr(fresh_observed, name))
