"""The KV tier in one run: offload, disaggregation and the store itself.

Usage: .venv/bin/python benchmarks/kv_tier_bench.py [--rounds 3] [--prompt-len 900]
                                                    [--sizes 10000,100000,1000000] [--mib 256]

Runs, one after the other on this machine, and prints each one's report:

1. ``kv_offload_bench.py``: TTFT of a long prompt evicted from a small local
   pool, recomputed (plain stack) vs loaded from the kvstore (``--kv-offload``);
2. ``disagg_bench.py``: TTFT and decode token gaps, ``--disaggregated`` vs plain;
3. ``kvstore_bench.py``: the store's put/get GB/s over loopback gRPC, and its
   put, get, lease and eviction cost per block at each of ``--sizes`` blocks.

Each part is its own process (separate stacks, no shared state); every part
prints its load average, since the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    stacks = ["--rounds", str(args.rounds), "--prompt-len", str(args.prompt_len)]
    parts = [
        ("1. offload: evicted long prompt, recompute vs load", "kv_offload_bench.py", stacks),
        ("2. prefill/decode disaggregation vs plain", "disagg_bench.py", stacks),
        ("3. the store", "kvstore_bench.py", ["--sizes", args.sizes, "--mib", str(args.mib)]),
    ]
    failed = []
    for title, script, script_args in parts:
        print(f"\n=== {title} ({script})", flush=True)
        code = subprocess.call([sys.executable, str(BENCHMARKS / script), *script_args])
        if code:
            failed.append(f"{script} exited with {code}")
    if failed:
        sys.exit("; ".join(failed))


if __name__ == "__main__":
    main()
