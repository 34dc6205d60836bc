"""Streaming requests to an OpenAI-compatible ``/v1/completions`` endpoint, timed per chunk.

Timing follows vLLM's ``async_request_openai_completions``: the clock starts
just before the request is sent; TTFT ends at the first SSE event carrying
``choices`` (even with empty text); every later such event adds one
inter-token gap; the end-to-end latency ends at the last such event (the
trailing usage event carries no token and does not count).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvmesh.services.cli.bench.dataset import SampleRequest
from kvmesh.services.cli.bench.sampling import GREEDY, SamplingSetting
from kvmesh.services.cli.bench.sse import sse_lines

logger = logging.getLogger(__name__)

_DATA_PREFIX = "data:"
_MAX_ERROR_CHARS = 1000


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds; start_time is ``time.perf_counter()``."""

    request_id: str
    prompt_len: int
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    # From the usage event when the server sends one, else the number of token events.
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    # Time spent waiting for the client's --max-concurrency semaphore (not in latency).
    queue_time: float = 0.0


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = True
    # The sampling fields each request sends (services/cli/bench/sampling.py); greedy by default.
    sampling: SamplingSetting = GREEDY
    # One keep-alive connection per concurrent request; more would only idle.
    max_connections: int = 256
    timeout_s: float = 6 * 60 * 60

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


class CompletionsClient:
    """One pooled ``httpx.AsyncClient`` shared by every request of a run."""

    def __init__(self, config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
        )
        self._http = httpx.AsyncClient(
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(config.timeout_s, connect=60.0),
            transport=transport,
        )

    async def __aenter__(self) -> CompletionsClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def first_model_id(self) -> str:
        """The first id listed by ``GET /v1/models`` (what --model defaults to)."""
        url = self.config.base_url.rstrip("/") + "/v1/models"
        try:
            response = await self._http.get(url)
            response.raise_for_status()
            models = response.json().get("data") or []
        except (httpx.HTTPError, ValueError) as exc:
            raise RuntimeError(f"could not list models at {url}: {exc}") from exc
        if not models:
            raise RuntimeError(f"{url} lists no models")
        return str(models[0]["id"])

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            **self.config.sampling.fields(),
            "ignore_eos": self.config.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, request: SampleRequest) -> RequestOutput:
        """Stream one completion; never raises: failures come back as ``success=False``."""
        output = RequestOutput(request_id=request.request_id, prompt_len=request.prompt_len)
        headers = {"x-request-id": request.request_id}
        text_parts: list[str] = []
        num_token_events = 0
        usage_tokens: int | None = None
        start = time.perf_counter()
        output.start_time = start
        last_token_time = start
        try:
            async with self._http.stream(
                "POST", self.config.url, json=self.payload(request), headers=headers
            ) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    output.error = f"HTTP {response.status_code}: {body[:_MAX_ERROR_CHARS]}"
                    return output
                async for line in sse_lines(response):
                    # Blank separators, ": ping" comments and "event:" lines carry no data.
                    if not line.startswith(_DATA_PREFIX):
                        continue
                    data = line[len(_DATA_PREFIX) :].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if choices := event.get("choices"):
                        now = time.perf_counter()
                        if num_token_events == 0:
                            output.ttft = now - start
                        else:
                            output.itl.append(now - last_token_time)
                        last_token_time = now
                        num_token_events += 1
                        text_parts.append(choices[0].get("text") or "")
                    elif usage := event.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        if usage.get("prompt_tokens") is not None:
                            output.prompt_len = usage["prompt_tokens"]
                    elif error := event.get("error"):
                        message = error.get("message") if isinstance(error, dict) else error
                        output.error = f"stream error: {message}"
                        return output
        except Exception as exc:
            output.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
            logger.debug("request %s failed", request.request_id, exc_info=True)
            return output
        output.generated_text = "".join(text_parts)
        if num_token_events == 0:
            output.error = "the stream ended without a token event (no TTFT)"
            return output
        output.success = True
        output.latency = last_token_time - start
        output.output_tokens = usage_tokens if usage_tokens else num_token_events
        return output
