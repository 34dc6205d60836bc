"""schemathesis with every check against a real stack's served /openapi.json (issue 43).

The stack runs with request-cost bounds a deployment could choose
(``FUZZ_STACK_ARGS``), so that no schema-valid request, however a fuzzer picks
``n``, ``max_tokens`` or the prompts, holds the 2-core server for long; the
cross-field rules no JSON Schema can state are in
tests/gateway/schemathesis_hooks.py. The CI-sized run is
tests/e2e/test_e2e_api_fuzz.py; this script is the full one::

    python -m benchmarks.api_fuzz                  # 100 examples per operation
    python -m benchmarks.api_fuzz --max-examples 25

It prints schemathesis's summary (cases, failures) and the wall time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass

from services.config import environment_without_options
from services.local_stack import REPO_ROOT, LocalStack

# A small context, few choices and short outputs: the bounds under test, and
# what keeps each generated generation under a second on 2 cores.
FUZZ_STACK_ARGS = [
    *("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256"),
    *("--max-n", "2", "--max-tokens-limit", "16", "--max-tokens-per-request", "1024"),
    *("--max-prompts-per-request", "4"),
]
HOOKS_MODULE = "tests.gateway.schemathesis_hooks"


@dataclass(frozen=True)
class FuzzRun:
    returncode: int
    output: str
    seconds: float

    @property
    def summary(self) -> str:
        """schemathesis's closing summary (from its SUMMARY banner on)."""
        lines = self.output.splitlines()
        start = next((i for i, line in enumerate(lines) if "SUMMARY" in line), len(lines) - 40)
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
        # A generation that took this long would be the bug this run looks for.
        *("--request-timeout", "60"),
    ]
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    return FuzzRun(done.returncode, done.stdout + done.stderr, time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    stack = LocalStack(FUZZ_STACK_ARGS)
    try:
        stack.wait_ready(600)
        run = run_schemathesis(stack.http_url, args.max_examples, args.seed)
    finally:
        code = stack.stop()
    print(run.summary)
    print(
        f"schemathesis --checks all --max-examples {args.max_examples} --seed {args.seed}: "
        f"exit {run.returncode} in {run.seconds:.0f} s (stack exit {code})"
    )
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
