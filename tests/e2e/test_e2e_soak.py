"""The soak, short (benchmarks/soak.py; `make soak` runs the full one): 60 requests,
concurrency 16, a fifth of them abandoned by their clients, one SIGKILL of an internal
service. Nothing may be lost, leaked or stuck."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.soak import NUM_KV_BLOCKS, SoakPlan, run_soak, summary_table

pytestmark = pytest.mark.e2e

PLAN = SoakPlan(num_requests=60, concurrency=16, num_kills=1, num_prompts=6, seed=14)


def test_a_short_soak_loses_nothing() -> None:
    stack = start_stack(["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "1024"])
    try:
        report = asyncio.run(run_soak(stack, PLAN))
    finally:
        code = stop_stack(stack)
    print(summary_table(report))
    assert report.lost == []
    assert report.completed + report.disconnected == PLAN.num_requests
    assert report.disconnected > 0 and len(report.kills) == 1
    assert report.leaked_blocks == 0 and report.stuck_in_scheduler == 0
    assert code == 0
