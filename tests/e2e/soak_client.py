"""Streamed completions as a client sees them, for the soak and the migration e2e tests.

One call streams one ``/v1/completions`` request (SSE, with usage) and
records what the client got: the text, the finish reason or error, the time
to the first text, and whether the client itself walked away (the soak's
random disconnects). Also: each service's resident memory, read from /proc.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.services.cli.bench.sse import sse_lines


@dataclass
class StreamResult:
    """One request's stream, from the client's side."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_tokens: int = 0  # usage.completion_tokens; 0 unless the stream finished
    ttft_s: float | None = None  # request sent -> first text
    # The client closed the stream on purpose (after ``disconnect_after`` events).
    disconnected: bool = False

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None


async def stream_completion(
    client: httpx.AsyncClient,
    body: dict,
    disconnect_after: int | None = None,
    on_event: Callable[[], None] | None = None,
) -> StreamResult:
    """Stream ``body`` (stream and usage forced on); hang up after ``disconnect_after`` events."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    events = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result = StreamResult(status=response.status_code)
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")
            return result
        async for line in sse_lines(response):
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.error = event["error"].get("message", str(event["error"]))
                break
            for choice in event.get("choices", []):
                if choice["text"] and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                result.text += choice["text"]
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if event.get("usage"):
                result.num_tokens = event["usage"]["completion_tokens"]
            events += 1
            if on_event is not None:
                on_event()
            if disconnect_after is not None and events >= disconnect_after:
                result.disconnected = True
                break  # leaving the block closes the connection: the gateway aborts
    return result


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None
