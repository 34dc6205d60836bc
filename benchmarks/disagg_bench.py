"""Prefill/decode disaggregation vs the plain stack: TTFT of long prompts, and decode
inter-token latency while long prompts arrive.

Usage: .venv/bin/python benchmarks/disagg_bench.py [--rounds 3] [--prompt-len 900]
                                                   [--stack-args "--num-threads 1"]

Two stacks, one after the other: plain, then ``--disaggregated``. On each:

- TTFT: ``--rounds`` fresh ~900-token prompts (never seen before, so no prefix
  hit anywhere), one at a time, ``max_tokens`` 4, each timed from sending to
  its first streamed token. On the disaggregated stack that time covers the
  prefill on the prefill replica, its saves to the kvstore, the lease, the
  decode replica's load and its recompute of the prompt's partial last block.
- Interference: one stream decodes 160 tokens while ``--rounds`` fresh long
  prompts arrive one after another; prints that stream's median and worst
  gap between tokens. On the plain stack each long prefill shares the decode's
  steps; disaggregated, it runs on the other worker (on a machine with cores
  for both: here both workers share the same two).

Prints each number, the disaggregated/plain ratios and the load average, since
the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402

STACK_ARGS = ["--num-kv-blocks", "256", "--max-model-len", "1024"]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(length)]


async def _token_times(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> list[float]:
    """perf_counter() at the send, then at each streamed token."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = [time.perf_counter()]
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


async def _ttft(client: httpx.AsyncClient, prompt: list[int]) -> float:
    times = await _token_times(client, prompt, 4)
    return times[1] - times[0]


async def _interference(
    client: httpx.AsyncClient, long_prompts: list[list[int]]
) -> tuple[float, float]:
    """(median, worst) gap between a decoding stream's tokens while long prompts arrive."""
    decode = asyncio.create_task(_token_times(client, _prompt(7, 32), 160))
    await asyncio.sleep(1.0)  # the stream is decoding
    for prompt in long_prompts:
        await _ttft(client, prompt)
    times = await decode
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # token to token
    return statistics.median(gaps), max(gaps)


async def _measure_stack(url: str, rounds: int, prompt_len: int, seed: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _ttft(client, _prompt(0, 64))  # warm-up: first steps, lazy inits
        ttfts = [await _ttft(client, _prompt(seed + r, prompt_len)) for r in range(rounds)]
        long_prompts = [_prompt(seed + 100 + r, prompt_len) for r in range(rounds)]
        median_gap, worst_gap = await _interference(client, long_prompts)
    return {"ttft": statistics.mean(ttfts), "median_gap": median_gap, "worst_gap": worst_gap}


def _measure(extra_args: list[str], rounds: int, prompt_len: int) -> dict[str, float]:
    stack = LocalStack(STACK_ARGS + extra_args)
    try:
        stack.wait_ready(900)
        # The same fresh prompts on both stacks (seeded), none of them seen before.
        return asyncio.run(_measure_stack(stack.http_url, rounds, prompt_len, seed=1000))
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--stack-args", default="", help="extra flags for both stacks")
    args = parser.parse_args()
    extra = args.stack_args.split()
    print(f"load average before: {os.getloadavg()}")
    results = {}
    for name, flags in (("plain", []), ("disaggregated", ["--disaggregated"])):
        results[name] = r = _measure(extra + flags, args.rounds, args.prompt_len)
        print(
            f"{name:>13}: TTFT {r['ttft'] * 1e3:7.0f} ms; decode gap while long prompts "
            f"arrive: median {r['median_gap'] * 1e3:5.0f} ms, worst {r['worst_gap'] * 1e3:6.0f} ms",
            flush=True,
        )
    plain, disagg = results["plain"], results["disaggregated"]
    print(
        f"{args.prompt_len}-token prompts, disaggregated / plain: TTFT "
        f"{disagg['ttft'] / plain['ttft']:.2f}x, worst decode gap "
        f"{disagg['worst_gap'] / plain['worst_gap']:.2f}x, median decode gap "
        f"{disagg['median_gap'] / plain['median_gap']:.2f}x; load average after: {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
