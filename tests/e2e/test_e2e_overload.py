"""Far past capacity: 200 or 429 for everyone, 429 at once, memory bounded.

Against a stack that holds 64 calls (``--max-inflight-requests 64``, a queue
of 64 waiting requests):

1. a burst of 2,000 concurrent tiny completions, all written at once: every
   answer is 200 or 429 (never 503: every service stays up), each 429 carries
   Retry-After, and the gateway's RSS stays bounded. These 429s cannot come
   within 100 ms on the 2-core dev box: uvicorn parses every request that has
   arrived before it runs any handler, so with 2,000 written at once even the
   first 429 waits for all 2,000 parses (h11, ~0.25 ms each on a quiet box,
   ~0.4 ms with the cores shared with the client, the worker and other jobs).
   The test holds them to a median under 3 s (measured: 0.6-0.8 s at a load
   average of 2-3, 1.8 s at 6; before the admission gate: 9.1 s, every call
   waiting on scheduler round trips) and prints the percentiles;
2. with the gateway full (64 long streams), newcomers one at a time: each gets
   its 429 within 100 ms (p90: a loaded 2-core box has hiccups);
3. the long streams' clients leave: their KV blocks all come back.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter

import httpx
import pytest
import uvloop

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e.burst import (
    Answer,
    burst,
    cpu_seconds,
    open_streams,
    percentile,
    rss_mib,
    sequential,
)
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_worker_failure import _wait_for

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 2000
CAPACITY = 64
TINY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
LONG = {"prompt": "Tell me a story.", "max_tokens": 128, "ignore_eos": True}
SERVICES = ("gateway", "scheduler", "detokenizer", "worker", "kvstore")


class RssSampler:
    """Max RSS (MiB) of each service process, sampled every 100 ms on a thread, and
    the CPU seconds each spent meanwhile."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = {name: rss_mib(pid) for name, pid in pids.items()}
        self.peak = dict(self.before)
        self.cpu_s = {name: -cpu_seconds(pid) for name, pid in pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_mib(pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for name, pid in self.pids.items():
            self.cpu_s[name] += cpu_seconds(pid)


def service_pids(stack: LocalStack) -> dict[str, int]:
    return {name: stack.service_pid(name) for name in SERVICES}


def report(answers: list[Answer], sampler: RssSampler) -> None:
    print(f"\nstatuses: {dict(Counter(a.status for a in answers))}")
    refused = [a.latency_s for a in answers if a.status == 429]
    if refused:
        p50, p90, p99, top = (1000 * percentile(refused, q) for q in (0.5, 0.9, 0.99, 1.0))
        print(f"429 latency ms: p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {top:.0f}")
    served = [a.latency_s for a in answers if a.status == 200]
    if served:
        print(f"200 latency s: p50 {percentile(served, 0.5):.2f}, max {max(served):.2f}")
    for name in SERVICES:
        before, peak = sampler.before[name], sampler.peak[name]
        cpu = sampler.cpu_s[name]
        print(f"{name:12s} RSS MiB: before {before:.0f}, peak {peak:.0f}; CPU {cpu:.1f} s")


def _kv_usage(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    match = re.search(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def test_far_past_capacity_every_answer_is_200_or_a_prompt_429() -> None:
    stack = start_stack(
        [
            *("--num-kv-blocks", "1024", "--max-waiting-requests", str(CAPACITY)),
            *("--max-inflight-requests", str(CAPACITY)),
        ]
    )
    port = stack.ports["http_port"]
    try:
        with RssSampler(service_pids(stack)) as sampler:
            answers = uvloop.run(burst(port, TINY, NUM_REQUESTS, 600))
        report(answers, sampler)
        statuses = Counter(a.status for a in answers)
        assert set(statuses) == {200, 429}, statuses
        assert statuses[200] >= CAPACITY // 2, statuses
        refused = [a for a in answers if a.status == 429]
        assert all(a.retry_after == "1" for a in refused)
        assert all(b'"choices"' in a.body for a in answers if a.status == 200)
        assert percentile([a.latency_s for a in refused], 0.5) < 3.0
        assert sampler.peak["gateway"] - sampler.before["gateway"] < 100, "gateway RSS grew"

        async def full_then_newcomers() -> list[Answer]:
            streams = await open_streams(port, LONG, CAPACITY + 16)
            await asyncio.sleep(1.0)  # every stream reached the gateway
            try:
                return await sequential(port, TINY, 50)
            finally:
                for writer in streams:
                    writer.close()

        newcomers = uvloop.run(full_then_newcomers())
        assert {a.status for a in newcomers} == {429}
        latencies = [a.latency_s for a in newcomers]
        p50, p90 = (1000 * percentile(latencies, q) for q in (0.5, 0.9))
        print(f"newcomers at a full gateway, 429 latency ms: p50 {p50:.1f}, p90 {p90:.1f}")
        assert p90 < 100
        usage = stack.metrics_url("scheduler")
        assert _wait_for(lambda: _kv_usage(usage) == 0, 30), "KV blocks not freed"
    finally:
        assert stop_stack(stack) == 0
