"""A TP=2 replica with the kvstore tier, and a rank that dies.

Each rank saves and loads its own shard of every block under its own layout
(tp_rank of tp_size); the scheduler counts a block loaded only once both
ranks loaded theirs. Outputs must equal transformers' greedy tokens whether a
prompt is computed or loaded from the store. Killing rank 1 fails the
requests in flight, the launcher restarts both ranks, and the replica serves
again.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvmesh.services.cli.local_stack import LocalStack, _children_of
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS, _grpc_generate
from tests.e2e.test_e2e_kv_offload import LONG_PROMPTS, _evict_local_cache, _generate_all, _metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tp_offload_stack() -> LocalStack:
    stack = start_stack(
        [
            "--kv-offload",
            "--num-kv-blocks",
            "48",
            "--max-model-len",
            "512",
            "--tensor-parallel-size",
            "2",
        ]
    )
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [hf_oracle.greedy(ids, MAX_TOKENS) for ids in LONG_PROMPTS]


def _rank_pid(stack: LocalStack, rank: int) -> int:
    pids = [p for p, cmd in _children_of(stack.process.pid).items() if f"--rank {rank}" in cmd]
    assert len(pids) == 1, pids
    return pids[0]


def test_tp2_outputs_equal_hf_computed_then_loaded_from_the_store(
    tp_offload_stack: LocalStack, expected: list[list[int]]
) -> None:
    assert asyncio.run(_generate_all(tp_offload_stack, LONG_PROMPTS, concurrency=1)) == expected
    _evict_local_cache(tp_offload_stack)
    hits_before = _metric(tp_offload_stack, "scheduler", "vllm:external_prefix_cache_hits_total")
    assert asyncio.run(_generate_all(tp_offload_stack, LONG_PROMPTS, concurrency=3)) == expected
    hits = _metric(tp_offload_stack, "scheduler", "vllm:external_prefix_cache_hits_total")
    assert hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in LONG_PROMPTS)


def test_a_dead_rank_costs_time_not_its_request(
    tp_offload_stack: LocalStack, expected: list[list[int]]
) -> None:
    """SIGKILL of a non-driver rank mid-generation: the replica restarts as a whole
    and the scheduler migrates the request onto it (issue "Nothing lost"), so the
    stream pauses and ends with the undisturbed greedy output."""
    old_rank1 = _rank_pid(tp_offload_stack, 1)

    async def generate_and_kill() -> list[int]:
        generation = asyncio.ensure_future(
            _grpc_generate(tp_offload_stack.grpc_addr, LONG_PROMPTS[0])
        )
        await asyncio.sleep(1.0)
        os.kill(old_rank1, signal.SIGKILL)
        return await generation

    assert asyncio.run(generate_and_kill()) == expected[0]
    assert _rank_pid(tp_offload_stack, 1) != old_rank1
