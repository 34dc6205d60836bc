"""A dead gateway costs its requests, not the worker's time: the detokenizer has the
scheduler abort them at once instead of running them on to max_tokens for nobody, and
their KV blocks are freed. (A dead detokenizer, scheduler or worker costs no request:
tests/e2e/test_e2e_migration.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_worker_failure import _wait_for

pytestmark = pytest.mark.e2e

# Long enough (800 tokens, ~20 s at best here) that "still running" is unmistakable.
BODY = {"prompt": "Tell me a story.", "max_tokens": 800, "ignore_eos": True, "stream": True}


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not exported"
    return float(match.group(1))


def _stream_until_tokens_flow(url: str, stop_after: int, on_flowing) -> list[dict]:
    """Stream BODY; after ``stop_after`` events call ``on_flowing``; read to the end."""
    events: list[dict] = []
    try:
        with (
            httpx.Client(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=BODY) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == stop_after:
                        on_flowing()
    except httpx.HTTPError:
        pass  # the gateway itself died under the stream
    return events


def _kill_mid_stream(stack, victim: str) -> float:
    """Kill ``victim`` while a request streams; seconds until the scheduler stopped running it."""
    assert _wait_for(lambda: httpx.get(stack.http_url + "/ready").status_code == 200, 120)
    old = stack.service_pid(victim)
    killed_at: list[float] = []

    def kill() -> None:
        os.kill(old, signal.SIGKILL)
        killed_at.append(time.monotonic())

    # The gateway's death also cuts these streams: read them on threads. Eight at once,
    # the first kills after its fifth event.
    readers = [
        threading.Thread(
            target=_stream_until_tokens_flow,
            args=(stack.http_url, 5, kill) if i == 0 else (stack.http_url, -1, lambda: None),
            daemon=True,
        )
        for i in range(8)
    ]
    for reader in readers:
        reader.start()
    assert _wait_for(lambda: bool(killed_at), 120), f"no tokens before killing {victim}"
    running = stack.metrics_url("scheduler")
    stopped = _wait_for(lambda: _gauge(running, "vllm:num_requests_running") == 0, 10)
    assert stopped, f"the request of a dead {victim} kept running"
    stopped_after = time.monotonic() - killed_at[0]
    for reader in readers:
        reader.join(timeout=60)
    assert _wait_for(lambda: _pid_changed(stack, victim, old), 60)
    return stopped_after


def _pid_changed(stack: LocalStack, service: str, old: int) -> bool:
    pids = stack.service_pids(service)
    return bool(pids) and old not in pids


def test_requests_of_a_dead_gateway_stop_running_and_free_their_blocks() -> None:
    stack = start_stack(["--num-kv-blocks", "256", "--max-model-len", "1024"])
    try:
        assert _kill_mid_stream(stack, "gateway") < 10
        usage = _gauge(stack.metrics_url("scheduler"), "vllm:kv_cache_usage_perc")
        assert usage == 0, "blocks leaked"
    finally:
        assert stop_stack(stack) == 0
