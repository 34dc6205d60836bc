"""The soak, short (benchmarks/soak.py; `make soak` runs the full one): 60 requests,
concurrency 16, a fifth of them abandoned by their clients, one SIGKILL of an internal
service. Nothing may be lost, leaked or stuck."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import start_stack, stop_stack
from tests.e2e.soak import (
    NUM_KV_BLOCKS,
    SoakPlan,
    SoakRequest,
    differ_from_solo,
    run_soak,
    summary_table,
)
from tests.e2e.soak_client import StreamResult

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


def test_texts_that_differ_from_the_solo_run_are_counted() -> None:
    """Only complete texts count: an abandoned or failed request has none."""
    a, b = SoakRequest("a", 8, None), SoakRequest("b", 8, None)
    solo = {("a", 8): StreamResult(200, "x", "length"), ("b", 8): StreamResult(200, "y", "length")}
    results: list[StreamResult | BaseException] = [
        StreamResult(200, "x", "length"),  # same
        StreamResult(200, "z", "length"),  # differs
        StreamResult(200, "q", None, disconnected=True),  # abandoned by its client
        StreamResult(500, "", None, error="boom"),  # failed
        TimeoutError("stuck"),
    ]
    assert differ_from_solo([a, b, a, b, a], results, solo) == (1, 2)
