"""A restarting stage costs new requests time, never a refusal (issue 43).

Issue 43 found that right after a scheduler or worker restart ``/ready``
answered 200 while new requests got ``503 no engine replica is ready`` for about
2 s (the router re-probed at its next poll), and that requests sent during the
restart all failed. Here one stage is SIGKILLed; 8 requests are sent at once
while it restarts and 8 more the moment ``/ready`` is 200 again: all 16 must
succeed with the text of an undisturbed run (greedy, float32), and the gateway
must count the requests that waited for a replica.
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
from tests.e2e.test_e2e_worker_failure import _wait_for

pytestmark = pytest.mark.e2e

TOPICS = (
    *("rivers", "bread", "owls", "glass", "salt", "bees", "chess", "stars"),
    *("maps", "tea", "clocks", "snow", "ships", "ink", "moss", "bells"),
)
MAX_TOKENS = 12


def _body(topic: str) -> dict:
    return {
        "prompt": f"Here are three facts about {topic}:\n1.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _complete(client: httpx.AsyncClient, topic: str) -> tuple[int, str]:
    response = await client.post("/v1/completions", json=_body(topic))
    if response.status_code != 200:
        return response.status_code, response.text
    return 200, response.json()["choices"][0]["text"]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _waits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^kvmesh_router_replica_waits_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def stack():
    s = start_stack(["--num-kv-blocks", "256", "--max-model-len", "1024"])
    yield s
    assert stop_stack(s) == 0


@pytest.fixture(scope="module")
def undisturbed(stack: LocalStack) -> dict[str, str]:
    async def run() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=300) as client:
            return await asyncio.gather(*(_complete(client, topic) for topic in TOPICS))

    answers = asyncio.run(run())
    assert all(status == 200 for status, _ in answers), answers
    return {topic: text for topic, (_, text) in zip(TOPICS, answers, strict=True)}


@pytest.mark.parametrize("victim", ["scheduler", "worker"])
def test_requests_during_and_right_after_a_restart_all_succeed(
    stack: LocalStack, undisturbed: dict[str, str], victim: str
) -> None:
    url = stack.http_url
    assert _wait_for(lambda: _ready(url), 120)
    waits_before = _waits(url)
    old = stack.service_pid(victim)
    during, after = TOPICS[:8], TOPICS[8:]

    async def run() -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            os.kill(old, signal.SIGKILL)
            # Sent while the stage is down: they wait for it rather than fail.
            first = [asyncio.ensure_future(_complete(client, t)) for t in during]
            # /ready as a client polls it: first 503 (the stage is gone), then
            # 200, at which moment the second wave goes.
            statuses: list[int] = []
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                status = (await client.get("/ready")).status_code
                statuses.append(status)
                if status == 200 and 503 in statuses:
                    break
                await asyncio.sleep(0.01)
            second = [asyncio.ensure_future(_complete(client, t)) for t in after]
            return await asyncio.gather(*first), await asyncio.gather(*second), statuses

    first, second, statuses = asyncio.run(run())
    assert 503 in statuses and statuses[-1] == 200, statuses[-20:]
    assert stack.service_pid(victim) != old  # it did restart
    for topic, (status, text) in zip(TOPICS, [*first, *second], strict=True):
        assert status == 200, (victim, topic, text)
        assert text == undisturbed[topic], (victim, topic)
    if victim == "scheduler":
        # Sent to a dead scheduler, the first wave was refused, waited and was
        # routed again. (A dead worker's scheduler may take them before it notices
        # and run them once the worker is back: no wait for the router to count.)
        assert _waits(url) >= waits_before + 1
