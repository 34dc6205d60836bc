"""schemathesis with every check against a real stack's served /openapi.json (issue 43).

The stack runs with request-cost bounds a deployment could choose
(``FUZZ_STACK_ARGS``), so that no schema-valid request, however a fuzzer picks
``n``, ``max_tokens`` or the prompts, holds the 2-core server for long; the
cross-field rules no JSON Schema can state are in
tests/gateway/schemathesis_hooks.py. The CI-sized run is
tests/e2e/test_e2e_api_fuzz.py; benchmarks/api_fuzz.py is the full one::

    python benchmarks/api_fuzz.py                  # 100 examples per operation
    python benchmarks/api_fuzz.py --max-examples 25

which prints schemathesis's summary (cases, failures) and the wall time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from kvmesh.services.cli.local_stack import REPO_ROOT
from kvmesh.services.runtime.config import environment_without_options

# A small context, few choices and short outputs: the bounds under test, and
# what keeps each generated generation under a second on 2 cores.
FUZZ_STACK_ARGS = [
    *("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256"),
    # Every bound here is in the served schema (maxItems on the prompt lists
    # for --max-prompts-per-request), so a schema-valid call never passes one.
    *("--max-n", "2", "--max-tokens-limit", "8", "--max-tokens-per-request", "1024"),
    *("--max-prompts-per-request", "4"),
]
HOOKS_MODULE = "tests.gateway.schemathesis_hooks"
MAX_RESPONSE_TIME_S = 60


def warm_up(base_url: str) -> None:
    """One completion and one chat first: a cold worker's first steps are its slowest,
    and the run's response-time check is about the requests, not the start-up."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", chat),
    ):
        httpx.post(base_url + path, json=body, timeout=300).raise_for_status()


@dataclass(frozen=True)
class FuzzRun:
    returncode: int
    output: str
    seconds: float

    @property
    def summary(self) -> str:
        """schemathesis's closing report: its failures (with the requests that
        reproduce them) and its summary."""
        lines = self.output.splitlines()
        banners = [i for i, line in enumerate(lines) if "FAILURES" in line or "SUMMARY" in line]
        start = banners[0] if banners else len(lines) - 40
        return "\n".join(lines[max(0, start) :])


def run_schemathesis(
    base_url: str, max_examples: int, seed: int = 1, timeout_s: float = 3600.0
) -> FuzzRun:
    """``schemathesis run --checks all`` against ``base_url``'s served schema."""
    env = {
        **environment_without_options(),
        "SCHEMATHESIS_HOOKS": HOOKS_MODULE,
        "PYTHONPATH": str(REPO_ROOT),
    }
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json"),
        *("--checks", "all", "--max-examples", str(max_examples), "--seed", str(seed)),
        *("--workers", "1", "--no-color", "--generation-database", "none"),
        # schemathesis's own default is 10 s; on 2 cores shared with six other
        # jobs (load average 12) 16-token generations took 13-30 s. A request
        # slower than this is still a failure: the run looks for requests that
        # hold the server.
        *("--max-response-time", str(MAX_RESPONSE_TIME_S)),
        *("--request-timeout", str(2 * MAX_RESPONSE_TIME_S)),
    ]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as late:
        # What it had found so far says which phase it was in and why it was slow.
        partial = late.stdout.decode() if isinstance(late.stdout, bytes) else late.stdout or ""
        return FuzzRun(-1, partial + f"\n(timed out after {timeout_s:.0f} s)", timeout_s)
    return FuzzRun(done.returncode, done.stdout + done.stderr, time.monotonic() - started)
