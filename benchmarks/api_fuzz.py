"""Schemathesis with all checks against the served OpenAPI schema of a real
stack: the full run (CI runs a short one, tests/e2e/test_e2e_api_fuzz.py; both
share tests/e2e/api_fuzz.py).

    python benchmarks/api_fuzz.py --max-examples 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402
from tests.e2e.api_fuzz import FUZZ_STACK_ARGS, run_schemathesis, warm_up  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=3600.0,
        help="stop schemathesis after this long and print what it found so far",
    )
    args = parser.parse_args()
    stack = LocalStack(FUZZ_STACK_ARGS)
    try:
        stack.wait_ready(600)
        warm_up(stack.http_url)
        run = run_schemathesis(stack.http_url, args.max_examples, args.seed, args.timeout_s)
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
