"""TTFT of a long prompt evicted from the local KV pool: recomputed vs loaded from the kvstore.

Usage: .venv/bin/python benchmarks/kv_offload_bench.py [--rounds 3] [--prompt-len 900]

Two stacks, one after the other, each with a small local pool
(``--num-kv-blocks 64`` = 1,024 tokens): plain, then ``--kv-offload``. Each
round sends prompt A (cold), prompt B (as long: it evicts A from the local
pool), then A again, and times A's second first token: the plain stack
recomputes A's prefill, the offload stack loads A's blocks from the store.
Prints mean TTFTs, their ratio (the issue's target: >= 3x) and the load
average, since the machine is shared and noisy. For the store's own
bandwidth and per-operation costs see benchmarks/kvstore_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402

STACK_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "1024"]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(length)]


def _ttft(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    return time.perf_counter() - started
    raise RuntimeError("stream ended without a token")


def _measure(extra_args: list[str], rounds: int, prompt_len: int) -> tuple[float, float]:
    """(mean cold TTFT, mean TTFT after local eviction) over ``rounds``."""
    stack = LocalStack(STACK_ARGS + extra_args)
    try:
        stack.wait_ready(600)
        _ttft(stack.http_url, _prompt(0, 64))  # warm-up: first step, lazy inits
        cold, evicted = [], []
        for r in range(rounds):
            a, b = _prompt(2 * r + 1, prompt_len), _prompt(2 * r + 2, prompt_len)
            cold.append(_ttft(stack.http_url, a))
            _ttft(stack.http_url, b)  # evicts a's blocks from the 64-block pool
            evicted.append(_ttft(stack.http_url, a))
    finally:
        stack.stop()
    return sum(cold) / rounds, sum(evicted) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=900)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    plain_cold, plain_evicted = _measure([], args.rounds, args.prompt_len)
    print(
        f"plain:   cold TTFT {plain_cold * 1e3:7.0f} ms, "
        f"evicted TTFT {plain_evicted * 1e3:7.0f} ms (recomputed)"
    )
    offload_cold, offload_evicted = _measure(["--kv-offload"], args.rounds, args.prompt_len)
    print(
        f"offload: cold TTFT {offload_cold * 1e3:7.0f} ms, "
        f"evicted TTFT {offload_evicted * 1e3:7.0f} ms (loaded from the kvstore)"
    )
    print(
        f"evicted prompt of {args.prompt_len} tokens: recompute / load = "
        f"{plain_evicted / offload_evicted:.2f}x; load average after: {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
