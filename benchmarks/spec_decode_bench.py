"""Speculative decoding vs plain decoding: where drafts pay and where they do not.

Usage: .venv/bin/python benchmarks/spec_decode_bench.py [--max-tokens 128]
                                                        [--stack-args "--num-threads 2"]

One stack per configuration, one after the other: plain (the defaults, async
scheduling on), ``--speculative-config`` n-gram, and suffix decoding. On each,
two workloads at concurrency 1 and 16:

- repetitive: chat requests to repeat a paragraph word for word, and to rename
  an identifier in a short function (the answer copies most of the prompt);
  greedy, as such edits are usually run;
- random: prompts of random token ids sampled at temperature 1 (nothing to
  copy, nothing repeats: the drafts' worst case).

Each cell prints output tok/s (all tokens / wall time), TPOT (mean over
requests of the time between their first and last token per further token)
and, with speculation, the mean acceptance length (tokens per verifying step:
accepted drafts + 1, from the scheduler's vllm:spec_decode_* counters); then
the ratios against plain in the same run, and the load average, since the
machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from services.local_stack import LocalStack  # noqa: E402

STACK_ARGS = ["--num-kv-blocks", "1024", "--max-model-len", "1024"]
CONFIGS = {
    "plain": [],
    "ngram": [
        "--speculative-config",
        json.dumps(
            {
                "method": "ngram",
                "num_speculative_tokens": 5,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 4,
            }
        ),
    ],
    "suffix": [
        "--speculative-config",
        json.dumps({"method": "suffix", "num_speculative_tokens": 5}),
    ],
}
CONCURRENCIES = (1, 16)
PARAGRAPHS = [
    "The committee met on Tuesday to discuss the budget for the new library. After a long "
    "debate, they agreed to fund the project in two phases, starting with the reading rooms "
    "and the children's wing, and leaving the archive for the following year.",
    "Our store will be closed on Monday for inventory. Orders placed over the weekend will "
    "ship on Tuesday morning, and customers who need help can reach the support team by "
    "email at any time. We thank you for your patience and your loyalty.",
    "The river rises every spring when the snow melts in the mountains. Farmers along the "
    "valley move their animals to higher ground, and the old bridge is closed until the "
    "water falls again, usually by the middle of May.",
    "To reset your password, open the settings page, choose the security tab and press the "
    "reset button. A link will be sent to your email address; the link expires after one "
    "hour, so please use it as soon as it arrives.",
]
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def repetitive_prompts() -> list[str]:
    prompts = [_chat(f"Repeat the following text word for word.\nText: {p}") for p in PARAGRAPHS]
    prompts.append(_chat(f"Rename the variable subtotal to net_amount in this code:\n{CODE}"))
    prompts.append(_chat(f"Rename the function total_price to order_total:\n{CODE}"))
    return prompts


def random_prompts(count: int) -> list[list[int]]:
    return [[random.Random(i).randrange(100, 40_000) for _ in range(64)] for i in range(count)]


async def _one(
    client: httpx.AsyncClient, prompt: str | list[int], max_tokens: int, temperature: float
) -> tuple[int, float | None]:
    """(output tokens, TPOT) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    tpot = (last - first) / (num_tokens - 1) if first and last and num_tokens > 1 else None
    return num_tokens, tpot


def _counter(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


async def _cell(
    stack: LocalStack, prompts: list, concurrency: int, max_tokens: int, temperature: float
) -> dict[str, float]:
    metrics = stack.metrics_url("scheduler")
    drafts_before = _counter(metrics, "vllm:spec_decode_num_drafts_total")
    accepted_before = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(
        client: httpx.AsyncClient, prompt: str | list[int]
    ) -> tuple[int, float | None]:
        async with semaphore:
            return await _one(client, prompt, max_tokens, temperature)

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=900) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(limited(client, p) for p in prompts))
        wall = time.perf_counter() - started
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts_total") - drafts_before
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") - accepted_before
    tpots = [t for _, t in results if t is not None]
    return {
        "tok_s": sum(n for n, _ in results) / wall,
        "tpot_ms": statistics.mean(tpots) * 1e3,
        "acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "drafts_per_token": drafts / sum(n for n, _ in results),
    }


def _workloads() -> dict[int, dict[str, tuple[list, float]]]:
    """concurrency -> workload -> (prompts, temperature)."""
    repetitive = repetitive_prompts()
    return {
        1: {"repetitive": (repetitive[:3], 0.0), "random": (random_prompts(3), 1.0)},
        16: {"repetitive": ((repetitive * 3)[:16], 0.0), "random": (random_prompts(16), 1.0)},
    }


def _measure(extra: list[str], max_tokens: int) -> dict[tuple[str, int], dict[str, float]]:
    stack = LocalStack(STACK_ARGS + extra)
    try:
        stack.wait_ready(900)
        # Warm-up: first steps, lazy inits, grammar of nothing.
        asyncio.run(_cell(stack, random_prompts(2), 2, 16, 0.0))
        results = {}
        for concurrency, workloads in _workloads().items():
            for name, (prompts, temperature) in workloads.items():
                results[name, concurrency] = r = asyncio.run(
                    _cell(stack, prompts, concurrency, max_tokens, temperature)
                )
                print(
                    f"    {name:>10} x{concurrency:<2}: {r['tok_s']:6.1f} tok/s, TPOT "
                    f"{r['tpot_ms']:6.1f} ms, acceptance length {r['acceptance_length']:.2f}, "
                    f"drafts per token {r['drafts_per_token']:.2f}",
                    flush=True,
                )
        return results
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stack-args", default="", help="extra flags for every stack")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="which of " + ",".join(CONFIGS)
    )
    args = parser.parse_args()
    extra = args.stack_args.split()
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = {}
    for name in args.configs.split(","):
        print(f"{name}:", flush=True)
        results[name] = _measure(extra + CONFIGS[name], args.max_tokens)
    plain = results.get("plain")
    if plain is not None:
        for name, cells in results.items():
            if name == "plain":
                continue
            for key, r in cells.items():
                base = plain[key]
                print(
                    f"{name} / plain, {key[0]} x{key[1]}: tok/s {r['tok_s'] / base['tok_s']:.2f}x, "
                    f"TPOT {r['tpot_ms'] / base['tpot_ms']:.2f}x"
                )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
