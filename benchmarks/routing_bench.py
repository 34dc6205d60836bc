"""KV-aware routing vs round-robin and least-loaded, at 2 engine replicas.

Usage: .venv/bin/python benchmarks/routing_bench.py [--num-kv-blocks 48] [--requests 32]
                                                    [--stack-args "..."]

One stack per policy (``kvmesh up --data-parallel-size 2 --routing-policy P``),
one after the other, each replica with ``--num-kv-blocks`` blocks of 16 tokens.

- Shared prefixes (kv, round-robin, load): ``--prefixes`` system prompts of
  ``--prefix-len`` tokens, more blocks than one replica's pool holds but fewer
  than both pools together, so the policy decides the hit rate. Each prefix
  is sent once (warm-up), then ``--requests`` users, in random order of
  prefix, each the prefix plus a 16-token question of its own, ``max_tokens``
  4, 2 at a time. Prints requests/s, mean TTFT and the prompt tokens served
  from the prefix cache (the API's ``cached_tokens``).
- No shared prefix (kv, load): ``--requests`` fresh prompts of
  ``--prefix-len`` + 16 tokens, ``max_tokens`` 16, 4 at a time: routing can
  only balance load here, and kv must not do worse than load.

Prints each number, the ratios against kv measured in the same run, and the
load average, since the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402
from kvmesh.services.runtime.config import RoutingPolicyName  # noqa: E402

BLOCK_SIZE = 16
QUESTION_LEN = 16


@dataclass(frozen=True)
class Result:
    requests_per_s: float
    output_tokens_per_s: float
    mean_ttft_s: float
    cached_fraction: float


def _tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(length)]


async def _request(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[float, int, int]:
    """(TTFT, prompt tokens, of which cached) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = 0.0
    usage: dict = {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not first:
                first = time.perf_counter() - sent
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return first, usage.get("prompt_tokens", len(prompt)), cached


async def _run(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> Result:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        pending = iter(prompts)
        results: list[tuple[float, int, int]] = []

        async def user() -> None:
            for prompt in pending:
                results.append(await _request(client, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Result(
        requests_per_s=len(prompts) / elapsed,
        output_tokens_per_s=len(prompts) * max_tokens / elapsed,
        mean_ttft_s=statistics.mean(r[0] for r in results),
        cached_fraction=sum(r[2] for r in results) / sum(r[1] for r in results),
    )


async def _warm_up(url: str, prompts: list[list[int]]) -> None:
    """Each prompt once, one at a time (the first steps and lazy inits, and the
    prefixes' first placement, happen here, not in the measurement)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for prompt in prompts:
            await _request(client, prompt, 1)


def _measure(policy: str, stack_args: list[str], workloads: dict[str, tuple]) -> dict[str, Result]:
    stack = LocalStack(["--data-parallel-size", "2", "--routing-policy", policy, *stack_args])
    try:
        stack.wait_ready(900)
        results = {}
        for name, (warm, prompts, max_tokens, concurrency) in workloads.items():
            asyncio.run(_warm_up(stack.http_url, warm))
            results[name] = asyncio.run(_run(stack.http_url, prompts, max_tokens, concurrency))
        return results
    finally:
        stack.stop()


def _report(workload: str, policy: str, r: Result, kv: Result | None) -> None:
    line = (
        f"{workload:>15} {policy:>11}: {r.requests_per_s:5.2f} req/s, "
        f"{r.output_tokens_per_s:6.1f} output tok/s, mean TTFT {r.mean_ttft_s * 1e3:6.0f} ms, "
        f"{r.cached_fraction:4.0%} of prompt tokens cached"
    )
    if kv is not None and r is not kv:
        line += (
            f"; kv: {r.mean_ttft_s / kv.mean_ttft_s:.2f}x lower mean TTFT, "
            f"{kv.requests_per_s / r.requests_per_s:.2f}x the throughput"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-kv-blocks", type=int, default=48, help="per replica")
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens per shared prefix")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--stack-args", default="", help="extra flags for every stack")
    args = parser.parse_args()
    prefix_blocks = args.prefixes * args.prefix_len // BLOCK_SIZE
    if not args.num_kv_blocks < prefix_blocks < 2 * args.num_kv_blocks:
        parser.error(
            f"the prefixes take {prefix_blocks} blocks: make that more than one replica's "
            f"pool ({args.num_kv_blocks}) and less than both ({2 * args.num_kv_blocks})"
        )
    rng = random.Random(0)
    prefixes = [_tokens(rng, args.prefix_len) for _ in range(args.prefixes)]
    shared = [[*rng.choice(prefixes), *_tokens(rng, QUESTION_LEN)] for _ in range(args.requests)]
    fresh = [_tokens(rng, args.prefix_len + QUESTION_LEN) for _ in range(args.requests)]
    warm = [[*p, *_tokens(rng, QUESTION_LEN)] for p in prefixes]
    workloads = {
        "shared prefixes": (warm, shared, 4, 2),
        "no shared prefix": ([_tokens(rng, 64)], fresh, 16, 4),
    }
    stack_args = [
        *("--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "1024"),
        *args.stack_args.split(),
    ]
    print(
        f"2 replicas x {args.num_kv_blocks} KV blocks of {BLOCK_SIZE} tokens; {args.prefixes} "
        f"prefixes x {args.prefix_len} tokens = {prefix_blocks} blocks; "
        f"load average before: {os.getloadavg()}",
        flush=True,
    )
    results: dict[str, dict[str, Result]] = {}
    for policy in (RoutingPolicyName.KV, RoutingPolicyName.ROUND_ROBIN, RoutingPolicyName.LOAD):
        # Round-robin is a baseline for shared prefixes only; load is kv's in both.
        chosen = (
            workloads
            if policy != RoutingPolicyName.ROUND_ROBIN
            else {"shared prefixes": workloads["shared prefixes"]}
        )
        results[policy] = _measure(policy, stack_args, chosen)
        for workload, result in results[policy].items():
            _report(workload, policy, result, None)
    print("summary (kv measured in the same run):")
    for workload in workloads:
        kv = results[RoutingPolicyName.KV][workload]
        for policy, by_workload in results.items():
            if workload in by_workload:
                _report(workload, policy, by_workload[workload], kv)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
