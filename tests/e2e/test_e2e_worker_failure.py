"""A dead or hung worker: its requests wait for the restarted worker and continue (request
migration), at most --max-migrations times; readiness drops meanwhile, and the stack heals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e


def _worker_pid(stack: LocalStack) -> int:
    return stack.service_pid("worker")


def _worker_pids(stack: LocalStack) -> list[int]:
    return stack.service_pids("worker")


def _stream_and_signal(
    url: str, pid: int, sig: signal.Signals, after_events: int, max_tokens: int = 800
) -> tuple[list[dict], float]:
    """Stream a long completion and send ``sig`` to ``pid`` after ``after_events``
    events; returns every event and when the signal was sent."""
    body = {
        "prompt": "Tell me a story.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
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


def test_past_max_migrations_a_killed_worker_fails_its_requests_then_recovers() -> None:
    """--max-migrations 0: the poison-request bound. The stream ends at once with an
    error saying why, instead of waiting for the restarted worker."""
    stack = start_stack(
        ["--num-kv-blocks", "256", "--max-model-len", "1024", "--max-migrations", "0"]
    )
    try:
        url = stack.http_url
        old_worker = _worker_pid(stack)
        events, _ = _stream_and_signal(url, old_worker, signal.SIGKILL, after_events=3)
        # The stream ended (no hang) with an error, not with a normal finish.
        assert len(events) >= 3
        assert "--max-migrations 0" in events[-1]["error"]["message"], events[-1]

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


def test_a_stopped_worker_is_failed_over_at_the_step_deadline_and_its_request_continues() -> None:
    """SIGSTOP: the worker is alive but hung. The step deadline gives it up (was 61 s:
    readiness drops within seconds), the launcher's liveness probe gets it restarted,
    and the request continues on the new worker to its last token.

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
        ready_seen: list[int] = []

        def watch_readiness() -> None:
            # While the stream waits: the deadline marks the worker lost, readiness drops.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not ready_seen:
                if httpx.get(url + "/ready", timeout=10).status_code == 503:
                    ready_seen.append(503)
                time.sleep(0.25)

        watcher = threading.Thread(target=watch_readiness, daemon=True)
        # After 12 events: past the cold start, so the deadline is measured.
        watcher.start()
        events, _ = _stream_and_signal(
            url, old_worker, signal.SIGSTOP, after_events=12, max_tokens=40
        )
        watcher.join(timeout=60)
        assert "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert ready_seen == [503], "readiness never reflected the hung worker"
        # Liveness failed (a stopped process answers no probe): killed, restarted.
        assert old_worker not in _worker_pids(stack)
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
