"""schemathesis, every check, against the served schema of a real stack (issue 43).

tests/gateway/test_gateway_openapi.py fuzzes the app over a fake engine; this
runs the same checks through the scheduler, worker and detokenizer, where a
schema-valid request that is too costly (n=2048) or that only a real engine
refuses (a huge top_k, a 64-bit seed) would show as a timeout or a 5xx. The
full run is ``python -m benchmarks.api_fuzz``.
"""

from __future__ import annotations

import pytest

from benchmarks.api_fuzz import FUZZ_STACK_ARGS, run_schemathesis, warm_up
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e

# Per operation: a run of a few minutes on 2 cores.
MAX_EXAMPLES = 10


def test_schemathesis_checks_all_pass_against_a_real_stack() -> None:
    stack = start_stack(FUZZ_STACK_ARGS)
    try:
        warm_up(stack.http_url)
        run = run_schemathesis(stack.http_url, MAX_EXAMPLES, timeout_s=600)
    finally:
        code = stop_stack(stack)
    assert run.returncode == 0, run.summary[:12000]
    assert "No issues found" in run.output, run.summary
    assert code == 0, "stack did not stop cleanly:\n" + "".join(stack.log[-50:])
