"""A dead worker fails its requests with a clear error, readiness drops, and the stack heals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from services.local_stack import LocalStack
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e


def _worker_pid(stack: LocalStack) -> int:
    return stack.service_pid("worker")


def _worker_pids(stack: LocalStack) -> list[int]:
    return stack.service_pids("worker")


def _stream_and_signal(
    url: str, pid: int, sig: signal.Signals, after_events: int
) -> tuple[list[dict], float]:
    """Stream a long completion and send ``sig`` to ``pid`` after ``after_events``
    events; returns every event and when the signal was sent."""
    body = {"prompt": "Tell me a story.", "max_tokens": 800, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    signalled_at = 0.0
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == after_events:
                os.kill(pid, sig)
                signalled_at = time.monotonic()
    return events, signalled_at


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_killed_worker_fails_requests_then_recovers() -> None:
    stack = start_stack(["--num-kv-blocks", "256", "--max-model-len", "1024"])
    try:
        url = stack.http_url
        old_worker = _worker_pid(stack)
        events, _ = _stream_and_signal(url, old_worker, signal.SIGKILL, after_events=3)
        # The stream ended (no hang) with an error, not with a normal finish.
        assert len(events) >= 3
        assert "error" in events[-1], events[-1]

        # While the worker is down the stack is not ready and refuses work clearly.
        def refused() -> bool:
            r = httpx.post(
                url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
            )
            return r.status_code == 503 and "error" in r.json()

        down_seen = _wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 503, 10)
        assert down_seen or refused(), "readiness never reflected the dead worker"

        # The launcher restarts the worker; readiness returns and requests succeed again.
        assert _wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, 120)
        assert _worker_pid(stack) != old_worker
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "The sky is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert stop_stack(stack) == 0


def test_stopped_worker_costs_its_request_the_step_deadline_then_is_restarted() -> None:
    """SIGSTOP: the worker is alive but hung. Its request fails at the step deadline
    (was 61 s), and the launcher's liveness probe gets the worker restarted.

    The deadline here is max(3 s, 2 x p99 of the measured steps) so that it stays
    short on a loaded 2-core machine, where a decode step can take a second.
    """
    stack = start_stack(
        [
            *("--num-kv-blocks", "256", "--max-model-len", "1024"),
            *("--step-deadline-min-s", "3", "--step-deadline-p99-factor", "2"),
            *("--liveness-period-s", "2"),
        ]
    )
    old_worker = _worker_pid(stack)
    try:
        url = stack.http_url
        # After 12 events: past the cold start, so the deadline is measured.
        events, stopped_at = _stream_and_signal(url, old_worker, signal.SIGSTOP, after_events=12)
        failed_after = time.monotonic() - stopped_at
        # The deadline failed it over (the launcher's kill comes later, after 3 probes).
        assert "hung" in events[-1]["error"]["message"], events[-1]
        assert failed_after < 15, f"the request waited {failed_after:.1f}s for a hung worker"
        assert _wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 503, 10)

        # Liveness fails (a stopped process answers no probe): killed, restarted, ready.
        assert _wait_for(lambda: _worker_pids(stack) not in ([], [old_worker]), 60)
        assert _wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, 120)
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "The sky is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert any("liveness probes in a row" in line for line in stack.log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_worker, signal.SIGCONT)
        assert stop_stack(stack) == 0
