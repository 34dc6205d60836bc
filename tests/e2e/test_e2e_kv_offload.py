"""The kvstore as a second KV tier (`kvmesh up --kv-offload`), end to end.

A small local pool (48 blocks of 16 tokens) forgets prefixes fast; the store
remembers them. Outputs must equal transformers' greedy tokens whether a
prompt is computed, hit locally or loaded from the store — and stay equal when
the store is killed mid-run.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import httpx
import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS, PROMPTS, _grpc_generate

pytestmark = pytest.mark.e2e

# Long enough to hold full blocks worth loading (the e2e prompts are short).
LONG_PROMPTS = [
    [random.Random(seed).randrange(100, 40_000) for _ in range(length)]
    for seed, length in ((1, 300), (2, 200), (3, 130))
]


@pytest.fixture(scope="module")
def offload_stack() -> LocalStack:
    stack = start_stack(["--kv-offload", "--num-kv-blocks", "48", "--max-model-len", "512"])
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


@pytest.fixture(scope="module")
def cases() -> list[tuple[list[int], list[int]]]:
    return greedy_cases()


def greedy_cases() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy tokens) for the e2e prompts and LONG_PROMPTS."""
    tok = hf_oracle.tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS] + LONG_PROMPTS
    return [(ids, hf_oracle.greedy(ids, MAX_TOKENS)) for ids in prompts]


async def _generate_all(
    stack: LocalStack, prompts: list[list[int]], concurrency: int
) -> list[list[int]]:
    """Greedy token ids of each prompt through the public gRPC API."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt_ids: list[int]) -> list[int]:
        async with semaphore:
            return await _grpc_generate(stack.grpc_addr, prompt_ids)

    return await asyncio.gather(*(one(p) for p in prompts))


def _metric(stack: LocalStack, service: str, name: str) -> float:
    text = httpx.get(stack.metrics_url(service), timeout=10).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values)


def _evict_local_cache(stack: LocalStack) -> None:
    """Run two prompts that need more than the 48-block pool, so that every
    block of an earlier prompt is evicted locally."""
    fillers = [
        [random.Random(100 + i).randrange(100, 40_000) for _ in range(460)] for i in range(2)
    ]
    asyncio.run(_generate_all(stack, fillers, concurrency=1))


def test_outputs_equal_hf_computed_then_loaded_from_the_store(
    offload_stack: LocalStack, cases
) -> None:
    prompts = [ids for ids, _ in cases]
    expected = [tokens for _, tokens in cases]
    # First pass one at a time: computed, and every full block saved.
    assert asyncio.run(_generate_all(offload_stack, prompts, concurrency=1)) == expected
    _evict_local_cache(offload_stack)
    hits_before = _metric(offload_stack, "scheduler", "vllm:external_prefix_cache_hits_total")
    # Second pass 8 at a time: the blocks come back from the store.
    assert asyncio.run(_generate_all(offload_stack, prompts, concurrency=8)) == expected
    hits = _metric(offload_stack, "scheduler", "vllm:external_prefix_cache_hits_total")
    # Every full block of the long prompts (but the last, which holds the
    # prompt's last token and is recomputed for its logits).
    assert hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in LONG_PROMPTS)
    assert _metric(offload_stack, "scheduler", "kvmesh:kv_connector_failed_saves_total") == 0


def test_killing_the_store_mid_run_changes_no_output(offload_stack: LocalStack, cases) -> None:
    prompts = [ids for ids, _ in cases]
    expected = [tokens for _, tokens in cases]
    _evict_local_cache(offload_stack)

    async def run_and_kill() -> list[list[int]]:
        generation = asyncio.ensure_future(_generate_all(offload_stack, prompts, concurrency=8))
        await asyncio.sleep(0.3)
        os.kill(offload_stack.service_pid("kvstore"), signal.SIGKILL)
        return await generation

    assert asyncio.run(run_and_kill()) == expected
    # The launcher restarts the store; requests after that still match.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            offload_stack.service_pid("kvstore")
            break
        except LookupError:
            time.sleep(0.5)
    assert asyncio.run(_generate_all(offload_stack, prompts[-3:], 3)) == expected[-3:]
