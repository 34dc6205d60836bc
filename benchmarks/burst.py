"""N completions at once against a real stack: status counts, latency per status, RSS (issue 43).

The load comes from several client processes (``--processes``), each opening
its share of raw loopback sockets at one instant (a barrier), so that one
Python event loop is not the bottleneck being measured. For every request it
records when its TCP connect completed and when the status line came back,
both from that instant (CLOCK_MONOTONIC is one clock for all processes):
a slow connect is time in the gateway's accept queue (or SYN retries when it
overflowed), a slow status line after a quick connect is time in the gateway.

Then the same stack serves exactly ``bound`` requests at once, unloaded: the
admitted requests' throughput in the burst is reported against it.

    python -m benchmarks.burst --requests 6000 --processes 4
    python -m benchmarks.burst --requests 2000 --max-inflight-requests 200

Prints one table (status, count, p50/p99/max latency, max connect), the
gateway's own account of the refusals it wrote before the ASGI app (from its
accept of the connection to the 429 written, gateway/openai/door.py), and each
service's RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path

import httpx

from kvmesh.services.cli.local_stack import LocalStack

SERVICES = ("gateway", "scheduler", "detokenizer", "worker", "kvstore")


@dataclass(frozen=True)
class Outcome:
    status: int  # 0: no answer (connect or read failed)
    connect_s: float  # from the common start to the TCP connection
    latency_s: float  # from the common start to the status line


def _request_bytes(port: int, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + payload


async def _one(port: int, request: bytes, start: float, timeout_s: float) -> Outcome:
    connected = latency = -1.0
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            connected = time.monotonic() - start
            writer.write(request)
            await writer.drain()
            status_line = await reader.readline()
            latency = time.monotonic() - start
            await reader.read()  # the whole answer, as a client would
            writer.close()
        return Outcome(int(status_line.split()[1]), connected, latency)
    except (OSError, TimeoutError, IndexError, ValueError):
        return Outcome(0, connected, time.monotonic() - start)


async def _client(port: int, request: bytes, count: int, start: float, timeout_s: float):
    return await asyncio.gather(*(_one(port, request, start, timeout_s) for _ in range(count)))


def _client_process(
    port: int, request: bytes, count: int, barrier: Barrier, timeout_s: float, out
) -> None:
    barrier.wait()
    start = time.monotonic()
    outcomes = asyncio.run(_client(port, request, count, start, timeout_s))
    out.put([(o.status, o.connect_s, o.latency_s) for o in outcomes])


def burst(
    port: int, body: dict, num_requests: int, processes: int, timeout_s: float
) -> list[Outcome]:
    """``num_requests`` at once from ``processes`` client processes."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    out = context.Queue()
    request = _request_bytes(port, body)
    shares = [num_requests // processes + (i < num_requests % processes) for i in range(processes)]
    workers = [
        context.Process(
            target=_client_process, args=(port, request, share, barrier, timeout_s, out)
        )
        for share in shares
    ]
    for worker in workers:
        worker.start()
    rows = [row for _ in workers for row in out.get()]
    for worker in workers:
        worker.join()
    return [Outcome(*row) for row in rows]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| status | count | p50 latency s | p99 latency s | max latency s | max connect s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for status, count in sorted(Counter(o.status for o in outcomes).items()):
        mine = [o for o in outcomes if o.status == status]
        latency = [o.latency_s for o in mine]
        connect = max(o.connect_s for o in mine)
        lines.append(
            f"| {status or 'none'} | {count} | {percentile(latency, 0.5):.2f} | "
            f"{percentile(latency, 0.99):.2f} | {max(latency):.2f} | {connect:.2f} |"
        )
    return "\n".join(lines)


def served_throughput(outcomes: list[Outcome]) -> float:
    """Admitted (200) requests per second, from the start to the last one's answer."""
    served = [o.latency_s for o in outcomes if o.status == 200]
    return len(served) / max(served) if served else 0.0


DOOR_METRIC = "kvmesh_gateway_door_refusal_seconds"


def door_refusals(metrics_text: str) -> str:
    """The door's refusal count and the bucket bounds its median and slowest fall under."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith(f"{DOOR_METRIC}_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return "gateway: no refusal written before the ASGI app"

    def under(fraction: float) -> float:
        return next(bound for bound, count in buckets if count >= fraction * total)

    return (
        f"gateway, accept to 429 written, for the {total:.0f} refused before the app: "
        f"p50 <= {under(0.5):g} s, max <= {under(1.0):g} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--max-inflight-requests", type=int, default=0, help="the gateway's bound (0: its default)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("stack_args", nargs="*", help="more `kvmesh up` flags (after --)")
    args = parser.parse_args()
    stack_args = ["--dtype", "float32", "--num-kv-blocks", "1024", *args.stack_args]
    if args.max_inflight_requests:
        stack_args += ["--max-inflight-requests", str(args.max_inflight_requests)]
    body = {"prompt": "Say hi.", "max_tokens": args.max_tokens, "ignore_eos": True}
    stack = LocalStack(stack_args)
    try:
        stack.wait_ready(600)
        port = stack.ports["http_port"]
        pids = {name: stack.service_pid(name) for name in SERVICES}
        httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=120).raise_for_status()
        before = {name: rss_mib(pid) for name, pid in pids.items()}
        started = time.monotonic()
        outcomes = burst(port, body, args.requests, args.processes, args.timeout_s)
        seconds = time.monotonic() - started
        after = {name: rss_mib(pid) for name, pid in pids.items()}
        door = door_refusals(httpx.get(f"{stack.http_url}/metrics", timeout=60).text)
        bound = sum(o.status == 200 for o in outcomes)
        unloaded = burst(port, body, bound, args.processes, args.timeout_s) if bound else []
    finally:
        stack.stop()
    print(f"{args.requests} requests at once ({args.processes} client processes), {seconds:.1f} s:")
    print(table(outcomes))
    if unloaded:
        ratio = served_throughput(outcomes) / served_throughput(unloaded)
        print(
            f"admitted: {served_throughput(outcomes):.1f} req/s in the burst vs "
            f"{served_throughput(unloaded):.1f} req/s for {bound} alone "
            f"({ratio:.2f}x; statuses alone {dict(Counter(o.status for o in unloaded))})"
        )
    print(door)
    for name in SERVICES:
        print(f"{name:12s} RSS MiB: before {before[name]:.0f}, after {after[name]:.0f}")


if __name__ == "__main__":
    main()
