"""The soak (issue 14): nothing lost while clients walk away and services get SIGKILLed.

Usage: .venv/bin/python benchmarks/soak.py [--requests 2000] [--concurrency 32]
           [--kills 3] [--disconnect-fraction 0.2] [--prompts 16] [--seed 0] [--batch-invariant]
           [--no-solo-reference] [--stack-args "..."]
(``make soak``, with flags through ``SOAK_ARGS``: ``make soak
SOAK_ARGS=--batch-invariant``; tests/e2e/test_e2e_soak.py runs a short one in
``make test``.)

``--batch-invariant`` serves with the worker's batch-invariant mode
(kernels/batch_invariant.py). Every pair also runs alone first (unless
``--no-solo-reference``), and the table counts the complete texts that differ
from that solo run: how many answers depended on the batch.
The soak itself (what it runs and how it judges) is ``tests/e2e/soak.py``,
shared with that test.

Prints a summary table and exits 1 unless lost = leaked = stuck = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402
from tests.e2e.soak import STACK_ARGS, SoakPlan, run_soak, summary_table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=SoakPlan.num_requests)
    parser.add_argument("--concurrency", type=int, default=SoakPlan.concurrency)
    parser.add_argument("--kills", type=int, default=SoakPlan.num_kills)
    parser.add_argument("--disconnect-fraction", type=float, default=SoakPlan.disconnect_fraction)
    parser.add_argument(
        "--prompts", type=int, default=SoakPlan.num_prompts, help="distinct prompts drawn from"
    )
    parser.add_argument("--seed", type=int, default=SoakPlan.seed)
    parser.add_argument("--request-timeout-s", type=float, default=SoakPlan.request_timeout_s)
    parser.add_argument(
        "--batch-invariant", action="store_true", help="serve with `kvmesh up --batch-invariant`"
    )
    parser.add_argument(
        "--solo-reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every pair alone too and count the texts that differ from it",
    )
    parser.add_argument("--stack-args", default="", help="extra `kvmesh up` flags")
    args = parser.parse_args()
    plan = SoakPlan(
        num_requests=args.requests,
        concurrency=args.concurrency,
        disconnect_fraction=args.disconnect_fraction,
        num_kills=args.kills,
        num_prompts=args.prompts,
        seed=args.seed,
        request_timeout_s=args.request_timeout_s,
        solo_reference=args.solo_reference,
    )
    invariant = ["--batch-invariant"] if args.batch_invariant else []
    stack = LocalStack([*STACK_ARGS, *invariant, *shlex.split(args.stack_args)])
    try:
        stack.wait_ready(900)
        report = asyncio.run(run_soak(stack, plan))
    finally:
        code = stack.stop()
    print(f"soak: batch-invariant mode {'on' if args.batch_invariant else 'off'}")
    print(summary_table(report))
    for line in report.lost[:20]:
        print("lost", line)
    print(f"stack exit code {code}")
    return 0 if report.ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
