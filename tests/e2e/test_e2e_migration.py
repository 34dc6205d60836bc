"""A stage SIGKILLed mid-stream costs time, never a request (issue 14, request migration).

Eight concurrent greedy streams; one internal service is killed while they
run and restarted by the launcher. Every stream must finish as if nothing
happened: the same text as an undisturbed run of the same prompts, the full
token count, no error event, no duplicate or missing character.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.soak_client import StreamResult, stream_completion
from tests.e2e.test_e2e_worker_failure import _wait_for

pytestmark = pytest.mark.e2e

TOPICS = ("rivers", "bread", "owls", "glass", "salt", "bees", "chess", "stars")
MAX_TOKENS = 48
# Tokens streamed (over all eight) before the kill: well past the first, far from the end.
KILL_AFTER_EVENTS = 8 * 6


def _bodies() -> list[dict]:
    return [
        {
            "prompt": f"Here are three facts about {topic}:\n1.",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        for topic in TOPICS
    ]


def _stream_all(url: str, on_event=None) -> list[StreamResult]:
    async def run() -> list[StreamResult]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(
                *(stream_completion(client, body, on_event=on_event) for body in _bodies())
            )

    return asyncio.run(run())


def _counter(url: str, name: str, stage: str) -> float:
    text = httpx.get(url, timeout=10).text
    pattern = rf'^{re.escape(name)}_total{{[^}}]*stage="{stage}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


@pytest.fixture(scope="module")
def stack():
    s = start_stack(["--num-kv-blocks", "256", "--max-model-len", "1024"])
    yield s
    assert stop_stack(s) == 0


@pytest.fixture(scope="module")
def undisturbed(stack: LocalStack) -> list[str]:
    results = _stream_all(stack.http_url)
    assert all(r.completed and r.num_tokens == MAX_TOKENS for r in results), results
    return [r.text for r in results]


# Where each stage's migrations are counted, under which label.
COUNTED_AT = {
    "worker": ("scheduler", "worker"),
    "detokenizer": ("scheduler", "detokenizer"),
    "scheduler": ("gateway", "scheduler"),
}


@pytest.mark.parametrize("victim", ["worker", "detokenizer", "scheduler"])
def test_a_killed_stage_costs_time_not_requests(
    stack: LocalStack, undisturbed: list[str], victim: str
) -> None:
    url = stack.http_url
    assert _wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, 120)
    old = stack.service_pid(victim)
    events = 0
    killed_at: list[float] = []

    def count_and_kill() -> None:
        nonlocal events
        events += 1
        if events == KILL_AFTER_EVENTS:
            os.kill(old, signal.SIGKILL)
            killed_at.append(time.monotonic())

    started = time.monotonic()
    results = _stream_all(url, count_and_kill)
    assert killed_at, "the streams ended before the kill"
    for result, expected in zip(results, undisturbed, strict=True):
        assert result.completed, (victim, result)
        assert result.num_tokens == MAX_TOKENS
        assert result.text == expected
    # The pause is bounded: a restart, not a timeout.
    assert time.monotonic() - started < 180
    assert stack.service_pid(victim) != old
    where, stage = COUNTED_AT[victim]
    metrics = url + "/metrics" if where == "gateway" else stack.metrics_url(where)
    assert _counter(metrics, "kvmesh:request_migrations", stage) > 0
