"""A KV pool too small for the load: requests get preempted, and outputs do not change.

16 concurrent greedy generations need ~48 KV blocks at their peak (prompt ~12 +
32 new tokens each); the pool has 32. The scheduler must preempt (recompute) and
resume, every request must finish, the preemption counter must move, and every output must equal
Hugging Face's greedy output for that prompt alone.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 16
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def small_stack():
    s = start_stack(["--num-kv-blocks", "32", "--max-model-len", "256"])
    yield s
    assert stop_stack(s) == 0


def _prompts() -> list[list[int]]:
    tok = hf_oracle.tokenizer()
    topics = [
        "rivers",
        "mountains",
        "bread",
        "clocks",
        "trains",
        "owls",
        "glass",
        "music",
        "salt",
        "maps",
        "bees",
        "ships",
        "paper",
        "rain",
        "chess",
        "stars",
    ]
    return [tok(f"Here are three facts about {t}:\n1.")["input_ids"] for t in topics]


def _scheduler_metric(stack, name: str) -> float:
    text = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_preempted_requests_finish_with_unchanged_outputs(small_stack) -> None:
    prompts = _prompts()
    assert len(prompts) == NUM_REQUESTS

    async def one(client: httpx.AsyncClient, ids: list[int]) -> dict:
        r = await client.post(
            "/v1/completions",
            json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=small_stack.http_url, timeout=600) as client:
            return await asyncio.gather(*(one(client, ids) for ids in prompts))

    results = asyncio.run(run_all())
    assert _scheduler_metric(small_stack, "vllm:num_preemptions_total") > 0
    tok = hf_oracle.tokenizer()
    for ids, body in zip(prompts, results, strict=True):
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        expected = tok.decode(hf_oracle.greedy(ids, MAX_TOKENS), skip_special_tokens=True)
        assert body["choices"][0]["text"] == expected
    # Everything released once the load is gone.
    assert _scheduler_metric(small_stack, "vllm:kv_cache_usage_perc") == 0
