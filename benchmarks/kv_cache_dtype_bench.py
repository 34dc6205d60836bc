"""--kv-cache-dtype: decode attention time and KV pool size, auto vs int8 vs fp8.

Decode attention (the C++ op, kernels/csrc/paged_attention_cpu.cpp) for a batch
of ``--batch`` decodes of ``--context`` tokens each, over ``--layers`` layers'
caches in turn (so that no layer's K/V is still in cache when it is read
again), in the default model's shape (9 query heads, 3 KV heads, head_dim 64,
blocks of 16 scattered through the cache). Each format's step is timed on the
process CPU-time clock, one torch thread, the formats alternating round by
round so that the ratios survive a shared machine's load; prints the median
ms per layer call and each format's ratio to ``auto``.

Then the KV pool: blocks that ``--kv-cache-memory`` (bytes, default 1 GiB)
holds for the default model in float32 and bfloat16 under each format.

``--accuracy``: the default model in float32 with each cache format against
the float32 cache: teacher-forced top-1 agreement and perplexity over the
fixed text of tests/worker/quant_accuracy.py, and greedy agreement (tokens
before each prompt's first divergence, 32 per prompt) on the worker tests'
four prompts.

Usage: ``python benchmarks/kv_cache_dtype_bench.py [--context 2048 --batch 16] [--accuracy]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# The repository root, so that a checkout's own packages win over an editable install's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.kernels import kv_quant, native
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from tests.worker.conftest import PROMPT_TEXTS
from tests.worker.quant_accuracy import FIXED_TEXT, agreement, greedy_tokens, perplexity

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
NAMES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def layer_caches(
    name: str, num_blocks: int, layers: int, generator: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``layers`` (K, V) pairs of random values: float32, or quantized pages."""
    fmt = kv_quant.resolve(name)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pairs = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            values = torch.randn(shape, generator=generator)
            if fmt is None:
                pair.append(values)
                continue
            cache = kv_quant.allocate_pages(fmt, *shape)
            codes, scales = kv_quant.quantize(values, fmt)
            cache.copy_(codes)
            kv_quant.cache_scales(cache).copy_(scales)
            pair.append(cache)
        pairs.append((pair[0], pair[1]))
    return pairs


def forced_top1(runner: ModelRunner, token_ids: list[int]) -> list[int]:
    """The most likely next token at every position of ``token_ids`` (as a prompt)."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    driver.add_request("text", token_ids, params, 1)
    scored = driver.run()["text"].prompt_logprobs
    return [scored[position].top_token_ids[0] for position in range(1, len(token_ids))]


def accuracy() -> None:
    path = default_model_path()
    tokenizer = Tokenizer.from_pretrained(path)
    text = tokenizer.encode(FIXED_TEXT)
    prompts = [tokenizer.encode(prompt) for prompt in PROMPT_TEXTS]
    print(f"accuracy against the float32 cache, {path.name} in float32, {len(text)} tokens:")
    reference: tuple[list[int], list[list[int]]] | None = None
    for name in NAMES:
        runner = ModelRunner(
            ModelConfig.from_pretrained(path, max_model_len=512, dtype="float32"),
            CacheConfig(block_size=16, num_kv_blocks=96, kv_cache_dtype=name),
            num_threads=1,
        )
        forced, greedy = forced_top1(runner, text), greedy_tokens(runner, prompts, 32)
        if reference is None:
            reference = (forced, greedy)
        top1 = sum(a == b for a, b in zip(forced, reference[0], strict=True)) / len(forced)
        ppl, greedy_agreed = perplexity(runner, text), agreement(reference[1], greedy)
        print(
            f"  {name:9s} teacher-forced top-1 {top1:.4f}  perplexity {ppl:.4f}  "
            f"greedy agreement {greedy_agreed:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--accuracy", action="store_true", help="the model's accuracy too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    native.ensure_loaded()
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = cdiv(args.context, BLOCK)
    num_blocks = args.batch * blocks_per_seq
    # Blocks scattered through the cache, as a long-running pool hands them out.
    tables = torch.randperm(num_blocks, generator=generator).view(args.batch, blocks_per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    rows = torch.arange(args.batch)
    query = torch.randn(args.batch, HEADS, HEAD_DIM, generator=generator)
    out = torch.empty_like(query)
    caches = {name: layer_caches(name, num_blocks, args.layers, generator) for name in NAMES}

    def step(name: str) -> float:
        start = time.process_time()
        for k_cache, v_cache in caches[name]:
            torch.ops.kvmesh.paged_decode_attention(
                out, query, k_cache, v_cache, tables, lens, rows, HEAD_DIM**-0.5
            )
        return (time.process_time() - start) / args.layers * 1e3

    for name in NAMES:
        step(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for _ in range(args.rounds):
        for name in NAMES:
            times[name].append(step(name))
    level = native.loaded_level()
    print(
        f"decode attention, batch {args.batch} x context {args.context}, {args.layers} layers "
        f"in turn, 1 thread, level {level.name if level else '?'}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    base = statistics.median(times["auto"])
    for name in NAMES:
        kv_bytes = (
            sum(
                kv_quant.cache_pages(c).numel() * kv_quant.cache_pages(c).element_size()
                for c in caches[name][0]
            )
            / num_blocks
        )
        median = statistics.median(times[name])
        print(
            f"  {name:9s} {median:7.3f} ms/layer call (min {min(times[name]):.3f})  "
            f"{kv_bytes / 1024:5.2f} KiB K+V per block  x{base / median:.2f} vs auto"
        )
    path = default_model_path()
    print(f"KV pool in {args.kv_cache_memory / 2**20:.0f} MiB, {path.name}:")
    for dtype in ("float32", "bfloat16"):
        config = ModelConfig.from_pretrained(path, dtype=dtype)
        counts = {
            name: CacheConfig(
                kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_dtype=name
            ).resolve_num_kv_blocks(config)
            for name in NAMES
        }
        print(
            f"  {dtype:8s} model: "
            + ", ".join(f"{name} {count} blocks" for name, count in counts.items())
            + f" (int8 x{counts['int8'] / counts['auto']:.2f})"
        )
    if args.accuracy:
        accuracy()


if __name__ == "__main__":
    main()
