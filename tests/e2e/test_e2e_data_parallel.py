"""Two engine replicas behind one gateway (`kvmesh up --data-parallel-size 2`).

Greedy outputs equal transformers' float32 greedy tokens whichever replica
serves them; prompts sharing a long prefix land on the replica that holds it
(its scheduler counts the prefix hits, the other none) while unrelated
concurrent prompts spread over both; a SIGKILLed worker takes its replica out
of the picks, the other keeps serving, and the replica rejoins once the
launcher has restarted its worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_greedy_matches_hf import PROMPTS
from tests.e2e.test_e2e_worker_failure import _wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
BLOCK_SIZE = 16
# A system prompt of more than 12 full blocks, shared by the "users" below.
SHARED_PREFIX = (
    "You are a careful assistant for a small clockmaker's shop. Answer politely, in one "
    "sentence, and never invent prices. The shop opens at nine, closes at six, is closed on "
    "Sundays, repairs watches and wall clocks, and does not sell batteries. "
) * 5


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    # 96 blocks of 16 tokens per replica: room for a few concurrent prompts
    # and the shared prefix, small enough to start quickly on 2 cores.
    s = start_stack(
        ["--data-parallel-size", "2", "--num-kv-blocks", "96", "--max-model-len", "1024"]
    )
    # The stack is ready once one replica serves; these tests need both in the
    # picks (the second may join a probe period later on a slow machine).
    assert _wait_for(lambda: _routable(s) == 2, 60), "the second replica never became routable"
    yield s
    assert stop_stack(s) == 0, "stack did not stop cleanly:\n" + "".join(s.log[-50:])


def _metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` (whose label text contains ``labels``) at ``url``."""
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        match = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total


def _prefix_hits(stack: LocalStack, replica: int) -> float:
    return _metric(stack.metrics_url("scheduler", replica), "vllm:prefix_cache_hits_total")


def _decisions(stack: LocalStack, replica: int) -> float:
    labels = f'replica="replica-{replica}"'
    return _metric(stack.http_url + "/metrics", "kvmesh_router_decisions_total", labels)


def _complete(url: str, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _routable(stack: LocalStack) -> float:
    return _metric(stack.http_url + "/metrics", "kvmesh_router_routable_replicas")


def _routing_report(stack: LocalStack) -> str:
    """The gateway's routing metrics, for an assertion's message."""
    text = httpx.get(stack.http_url + "/metrics", timeout=10).text
    return "\n".join(line for line in text.splitlines() if line.startswith("kvmesh_router"))


def test_concurrent_greedy_outputs_match_hf_on_both_replicas(stack: LocalStack) -> None:
    tok = hf_oracle.tokenizer()
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    before = [_decisions(stack, i) for i in (0, 1)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda ids: _complete(stack.http_url, ids), prompt_ids))
    for ids, body in zip(prompt_ids, bodies, strict=True):
        expected = tok.decode(hf_oracle.greedy(ids, MAX_TOKENS), skip_special_tokens=True)
        assert body["choices"][0]["text"] == expected
    # Unrelated prompts in flight together spread over both replicas.
    assert all(_decisions(stack, i) > before[i] for i in (0, 1)), _routing_report(stack)


def test_prompts_sharing_a_long_prefix_land_on_the_replica_holding_it(stack: LocalStack) -> None:
    first = _complete(stack.http_url, SHARED_PREFIX + "Question 0: when do you open?")
    assert first["usage"]["prompt_tokens"] > 12 * BLOCK_SIZE
    time.sleep(0.5)  # the replica's KV events reach the router (sent once per step)
    hits_before = [_prefix_hits(stack, i) for i in (0, 1)]
    users = 4
    for user in range(1, users + 1):
        body = _complete(stack.http_url, SHARED_PREFIX + f"Question {user}: do you sell batteries?")
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 12 * BLOCK_SIZE, f"user {user}: {cached}\n{_routing_report(stack)}"
    gained = [_prefix_hits(stack, i) - hits_before[i] for i in (0, 1)]
    holder = 0 if gained[0] else 1
    assert gained[holder] >= users * 12 * BLOCK_SIZE, gained
    assert gained[1 - holder] == 0, gained


def _stream(url: str, prompt: str, max_tokens: int, events: list[dict]) -> None:
    """Stream a completion into ``events`` (each chunk as parsed JSON) until it ends."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):  # a chunk or an error; not [DONE]
                events.append(json.loads(line.removeprefix("data: ")))


def test_a_worker_killed_mid_run_leaves_the_picks_and_its_replica_rejoins(
    stack: LocalStack,
) -> None:
    # Two long streams in flight, one per replica (the second goes to the idler one).
    streams: list[list[dict]] = [[], []]
    with ThreadPoolExecutor(2) as pool:
        running = []
        for i, events in enumerate(streams):
            prompt = f"Stream {i}: tell me a long story about the sea."
            running.append(pool.submit(_stream, stack.http_url, prompt, 300, events))
            assert _wait_for(lambda events=events: len(events) >= 2, 120)
        victim = stack.replica_pid("worker", 1)
        os.kill(victim, signal.SIGKILL)
        assert _wait_for(lambda: _routable(stack) == 1, 15), "the dead replica stayed routable"
        # The other replica serves everything meanwhile, and no new request fails.
        served_before = _decisions(stack, 0)
        for i in range(3):
            body = _complete(stack.http_url, f"Request {i} while a replica is down:", max_tokens=4)
            assert body["usage"]["completion_tokens"] == 4
        assert _decisions(stack, 0) >= served_before + 3
        for future in running:
            future.result(timeout=300)
    # The stream on the dead replica ended with an error (or was carried on
    # elsewhere) instead of hanging; the one on the live replica ran to its length.
    finishes = [
        "error" if "error" in events[-1] else events[-1]["choices"][0]["finish_reason"]
        for events in streams
    ]
    assert sorted(finishes) in (["error", "length"], ["length", "length"]), finishes
    # The launcher restarts the worker; its replica is ready again and serves.
    assert _wait_for(lambda: _routable(stack) == 2, 180), "the replica never rejoined"
    assert stack.replica_pid("worker", 1) != victim
    rejoined_before = _decisions(stack, 1)
    with ThreadPoolExecutor(4) as pool:
        prompts = [f"Unrelated prompt number {i} after the restart:" for i in range(4)]
        for body in pool.map(lambda p: _complete(stack.http_url, p, max_tokens=4), prompts):
            assert body["usage"]["completion_tokens"] == 4
    assert _decisions(stack, 1) > rejoined_before
