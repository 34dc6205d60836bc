"""Speculative decoding vs plain decoding: where drafts pay and where they do not.

Usage: .venv/bin/python benchmarks/spec_decode_bench.py [--max-tokens 96] [--rounds 2]
           [--configs plain,ngram,suffix] [--threads 0] [--stack]

Two workloads, each at concurrency 1 and 16:

- repetitive: chat requests to repeat a paragraph word for word, and to rename
  an identifier in a short function (the answer copies most of the prompt);
  greedy, as such edits are usually run, each answer ending at its EOS;
- random: prompts of random token ids sampled at temperature 1, all
  ``--max-tokens`` of them (nothing to copy, nothing repeats: the drafts'
  worst case).

Configurations: plain, ``--speculative-config`` n-gram, and suffix decoding.
By default the engine runs in process (the real Scheduler driving a
ModelRunner, ``kvmesh/engine.py``) and the configurations alternate cell by
cell, ``--rounds`` times, so that a shared machine's load drifts over all of
them alike; ``--stack`` runs one full stack per configuration instead (HTTP,
plain with its default async scheduling), which needs a quiet machine.

Each cell prints output tok/s (all tokens / wall time), TPOT (mean over
requests of the time between their first and last token per further token)
and, with speculation, the mean acceptance length (tokens per verifying step:
accepted drafts + 1) and drafts per output token; in process also engine steps
(forward passes) per output token, which a shared machine's load cannot blur;
then the ratios against plain in the same run, and the load average.
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

from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402

STACK_ARGS = ["--num-kv-blocks", "1024", "--max-model-len", "1024"]
SPECULATIVE = {
    "plain": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
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
    # SmolLM2-135M paraphrases when asked to "repeat" a text (n-gram drafts then
    # miss most steps); asked to copy it exactly and nothing else, it copies,
    # as larger models do with either wording.
    prompts = [
        _chat(f"Copy the following text exactly, word for word, and write nothing else:\n\n{p}")
        for p in PARAGRAPHS
    ]
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
        "ignore_eos": _ignore_eos(temperature),
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


def _ignore_eos(temperature: float) -> bool:
    """Random prompts run to their length; greedy copies end where the model ends them."""
    return temperature > 0


def _workloads(repetitive: list) -> dict[int, dict[str, tuple[list, float]]]:
    """concurrency -> workload -> (prompts, temperature)."""
    return {
        1: {"repetitive": (repetitive[:3], 0.0), "random": (random_prompts(3), 1.0)},
        16: {"repetitive": ((repetitive * 3)[:16], 0.0), "random": (random_prompts(16), 1.0)},
    }


def _print_cell(name: str, concurrency: int, r: dict[str, float]) -> None:
    steps = f", steps per token {r['steps_per_token']:.3f}" if "steps_per_token" in r else ""
    print(
        f"    {name:>10} x{concurrency:<2}: {r['tok_s']:6.1f} tok/s, TPOT "
        f"{r['tpot_ms']:6.1f} ms, acceptance length {r['acceptance_length']:.2f}, "
        f"drafts per token {r['drafts_per_token']:.2f}{steps}",
        flush=True,
    )


def _stack_args(config: str) -> list[str]:
    spec = SPECULATIVE[config]
    return [] if spec is None else ["--speculative-config", json.dumps(spec)]


def measure_stack(
    configs: list[str], extra: list[str], max_tokens: int
) -> dict[str, dict[tuple[str, int], dict[str, float]]]:
    """One full stack per configuration, one after the other."""
    results: dict[str, dict[tuple[str, int], dict[str, float]]] = {}
    for config in configs:
        print(f"{config}:", flush=True)
        stack = LocalStack(STACK_ARGS + extra + _stack_args(config))
        try:
            stack.wait_ready(900)
            asyncio.run(_cell(stack, random_prompts(2), 2, 16, 0.0))  # warm-up
            cells = results[config] = {}
            for concurrency, workloads in _workloads(repetitive_prompts()).items():
                for name, (prompts, temperature) in workloads.items():
                    cells[name, concurrency] = r = asyncio.run(
                        _cell(stack, prompts, concurrency, max_tokens, temperature)
                    )
                    _print_cell(name, concurrency, r)
        finally:
            stack.stop()
    return results


def _inprocess_cell(
    runner: object, config: str, prompts: list[list[int]], concurrency: int, params: object
) -> dict[str, float]:
    from kvmesh.engine import InProcessEngine
    from kvmesh.services.runtime.config import SpeculativeConfig

    spec = SPECULATIVE[config]
    engine = InProcessEngine(
        runner,  # type: ignore[arg-type]
        speculative=None if spec is None else SpeculativeConfig(**spec),
    )
    steps_before = runner.timings.num_steps  # type: ignore[attr-defined]
    started = time.perf_counter()
    results = engine.generate(prompts, params, concurrency)  # type: ignore[arg-type]
    wall = time.perf_counter() - started
    num_steps = runner.timings.num_steps - steps_before  # type: ignore[attr-defined]
    num_tokens = sum(len(r.output_token_ids) for r in results)
    tpots = [
        (r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
        for r in results
        if r.finish_time and r.first_token_time and len(r.output_token_ids) > 1
    ]
    stats = engine.scheduler.make_stats().spec_decoding
    return {
        "tok_s": num_tokens / wall,
        "tpot_ms": statistics.mean(tpots) * 1e3,
        "acceptance_length": stats.mean_acceptance_length if stats else 0.0,
        "drafts_per_token": stats.num_drafts / num_tokens if stats else 0.0,
        "steps_per_token": num_steps / num_tokens,
    }


def measure_inprocess(
    configs: list[str], max_tokens: int, rounds: int, threads: int
) -> dict[str, dict[tuple[str, int], dict[str, float]]]:
    """Every cell, configurations alternating, ``rounds`` times; the mean of each."""
    from dataclasses import replace

    from tokenizers import Tokenizer

    from kvmesh.services.contracts.sampling_params import SamplingParams
    from kvmesh.services.runtime.model_prep import default_model_path
    from kvmesh.worker.config import CacheConfig, ModelConfig
    from kvmesh.worker.model_runner import ModelRunner

    path = default_model_path()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    runner = ModelRunner(
        ModelConfig.from_pretrained(path, dtype="float32", max_model_len=1024),
        CacheConfig(block_size=16, num_kv_blocks=2048),
        num_threads=threads or None,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    repetitive = [tokenizer.encode(p).ids for p in repetitive_prompts()]
    _inprocess_cell(runner, "plain", random_prompts(2), 2, replace(greedy, max_tokens=16))
    samples: dict[str, dict[tuple[str, int], list[dict[str, float]]]] = {c: {} for c in configs}
    for round_index in range(rounds):
        print(f"round {round_index + 1}:", flush=True)
        for concurrency, workloads in _workloads(repetitive).items():
            for name, (prompts, temperature) in workloads.items():
                params = replace(
                    greedy, temperature=temperature, ignore_eos=_ignore_eos(temperature)
                )
                for config in configs:
                    r = _inprocess_cell(runner, config, prompts, concurrency, params)
                    samples[config].setdefault((name, concurrency), []).append(r)
                    _print_cell(f"{config} {name}", concurrency, r)
    return {
        config: {
            key: {m: statistics.mean(r[m] for r in runs) for m in runs[0]}
            for key, runs in cells.items()
        }
        for config, cells in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="in-process rounds")
    parser.add_argument("--threads", type=int, default=0, help="in-process torch threads (0: all)")
    parser.add_argument("--configs", default=",".join(SPECULATIVE), help="subset of these")
    parser.add_argument("--stack", action="store_true", help="full stacks over HTTP instead")
    parser.add_argument("--stack-args", default="", help="extra flags for every stack")
    args = parser.parse_args()
    configs = args.configs.split(",")
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.stack:
        results = measure_stack(configs, args.stack_args.split(), args.max_tokens)
    else:
        results = measure_inprocess(configs, args.max_tokens, args.rounds, args.threads)
    print("means:")
    for config, cells in results.items():
        for (name, concurrency), r in cells.items():
            _print_cell(f"{config} {name}", concurrency, r)
    plain = results.get("plain")
    for config, cells in results.items():
        if plain is None or config == "plain":
            continue
        for key, r in cells.items():
            base = plain[key]
            print(
                f"{config} / plain, {key[0]} x{key[1]}: tok/s {r['tok_s'] / base['tok_s']:.2f}x, "
                f"TPOT {r['tpot_ms'] / base['tpot_ms']:.2f}x"
            )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
