"""A burst of concurrent tiny completions over raw loopback sockets, with each answer's latency.

Every connection is opened first, then every request is written in one go, so
that "sent" means the request's last byte left the client, and the latency of
an answer is from then to its status line. Raw sockets, not an HTTP client
library: 2,000 of them on the same 2 cores as the stack must not be the
bottleneck being measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Answer:
    status: int
    latency_s: float  # request sent -> status line received
    retry_after: str | None
    body: bytes


def _request_bytes(port: int, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + payload


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: bytes,
    go: asyncio.Event | None = None,
) -> Answer:
    if go is not None:
        await go.wait()
    writer.write(request)
    await writer.drain()
    sent = time.perf_counter()
    status_line = await reader.readline()
    latency = time.perf_counter() - sent
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.read()
    writer.close()
    return Answer(int(status_line.split()[1]), latency, headers.get("retry-after"), body)


async def burst(port: int, body: dict, num_requests: int, timeout_s: float) -> list[Answer]:
    """Open ``num_requests`` connections, send on each at once, collect every answer."""
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(num_requests)]
    go = asyncio.Event()
    request = _request_bytes(port, body)
    exchanges = [asyncio.ensure_future(_exchange(r, w, request, go)) for r, w in connections]
    go.set()
    return await asyncio.wait_for(asyncio.gather(*exchanges), timeout_s)


async def sequential(port: int, body: dict, num_requests: int) -> list[Answer]:
    """One request at a time, each on a new connection: what a newcomer sees."""
    request = _request_bytes(port, body)
    answers = []
    for _ in range(num_requests):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers.append(await _exchange(reader, writer, request))
    return answers


async def open_streams(port: int, body: dict, num_streams: int) -> list[asyncio.StreamWriter]:
    """Send ``num_streams`` streaming requests without reading their answers; each runs
    until its writer is closed (a client disconnect) or it ends."""
    request = _request_bytes(port, {**body, "stream": True})
    writers = []
    for _ in range(num_streams):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        writers.append(writer)
    return writers


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
