"""Prefill/decode disaggregation between two tensor-parallel replicas.

``kvmesh up --disaggregated --tensor-parallel-size 2``: the prefill replica is
two ranks of its own (their own rendezvous port and restart group), and each
of its ranks saves its shard of every block under its own layout (tp_rank of
tp_size), which the decode replica's same rank loads. Outputs must equal
transformers' greedy tokens, with every prompt block handed over, and nothing
may be left behind on either replica or in the store.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e import hf_oracle
from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.test_e2e_disaggregated import BLOCK, _assert_nothing_left, _gateway_prefills
from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS
from tests.e2e.test_e2e_kv_offload import LONG_PROMPTS, _generate_all, _metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tp_disagg_stack() -> LocalStack:
    stack = start_stack(
        [
            "--disaggregated",
            "--tensor-parallel-size",
            "2",
            "--num-kv-blocks",
            "128",
            "--max-model-len",
            "1024",
        ]
    )
    yield stack
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


def test_tp2_replicas_hand_over_every_block_and_equal_hf(tp_disagg_stack: LocalStack) -> None:
    expected = [hf_oracle.greedy(ids, MAX_TOKENS) for ids in LONG_PROMPTS]
    assert asyncio.run(_generate_all(tp_disagg_stack, LONG_PROMPTS, concurrency=1)) == expected
    # The decode replica computed none of the prompt blocks: all came from the
    # prefill replica's two ranks, each shard to its rank.
    loaded = _metric(tp_disagg_stack, "scheduler", "vllm:external_prefix_cache_hits_total")
    assert loaded == sum((len(p) - 1) // BLOCK * BLOCK for p in LONG_PROMPTS)
    assert _gateway_prefills(tp_disagg_stack, "transferred") == len(LONG_PROMPTS)
    assert _gateway_prefills(tp_disagg_stack, "failed") == 0
    _assert_nothing_left(tp_disagg_stack)
