"""schemathesis, every check, against the served schema of a real stack (issue 43).

tests/gateway/test_gateway_openapi.py fuzzes the app over a fake engine; this
runs the same checks through the scheduler, worker and detokenizer, where a
schema-valid request that is too costly (n=2048) or that only a real engine
refuses (a huge top_k, a 64-bit seed) would show as a timeout or a 5xx. The
full run is ``python -m benchmarks.api_fuzz``.
"""

from __future__ import annotations

import pytest

from tests.e2e.api_fuzz import FUZZ_STACK_ARGS, run_schemathesis, warm_up
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e

# Per operation and phase: about 200 cases, 1-3 minutes on 2 cores (10 took
# 75-200 s, and over 600 s with six other jobs at a load average of 17).
MAX_EXAMPLES = 5


def test_schemathesis_checks_all_pass_against_a_real_stack() -> None:
    stack = start_stack(FUZZ_STACK_ARGS)
    try:
        warm_up(stack.http_url)
        run = run_schemathesis(stack.http_url, MAX_EXAMPLES, timeout_s=900)
    finally:
        code = stop_stack(stack)
    assert run.returncode == 0, run.summary[-12000:]
    assert "No issues found" in run.output, run.summary
    assert code == 0, "stack did not stop cleanly:\n" + "".join(stack.log[-50:])
