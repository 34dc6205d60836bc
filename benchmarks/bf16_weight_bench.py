"""A bfloat16 checkpoint served in float32: its weights kept as bfloat16 words
(kernels/csrc/bf16_weight_linear.cpp, half the bytes per decode step) against
the float32 oneDNN-packed copy kvmesh kept before.

Builds every projection of a decoder from its ``config.json`` (random weights
rounded to bfloat16: only the shapes matter) — per layer q/k/v/o, gate/up and
down, plus the LM head — and runs one pass over all of them in model order at
each row count, as a decode step does, so that the weights stream from memory.
Prints milliseconds per pass for both paths, their ratio, and the weight bytes
each path reads per pass over its time (GB/s). The paths alternate within each
of ``--rounds`` rounds; the best round counts. What
``MAX_BF16_WEIGHT_KERNEL_ROWS`` in worker/models/linear.py is set from.

    python benchmarks/bf16_weight_bench.py --config /tmp/bench-qwen3/config.json \
        [--rows 1 4 16 32 64 128] [--rounds 5]

``benchmarks/family_checkpoint.py --family qwen3`` writes such a folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvmesh.worker.models.linear as linear_module
from kvmesh.kernels import native
from kvmesh.worker.models.linear import PackedLinear


def projection_shapes(config: dict) -> list[tuple[int, int]]:
    """(out_features, in_features) of every projection a decode step runs, in order."""
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or hidden // heads
    mlp = text["intermediate_size"]
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * mlp, hidden),
        (hidden, mlp),
    ]
    return layer * text["num_hidden_layers"] + [(text["vocab_size"], hidden)]


def pass_ms(
    projections: list[PackedLinear], inputs: dict[int, torch.Tensor], kernel_rows: int = 1 << 30
) -> float:
    """One pass; bfloat16-word projections take the kernel up to ``kernel_rows``
    rows, above it their weight widened into the scratch buffer for oneDNN."""
    saved = linear_module.MAX_BF16_WEIGHT_KERNEL_ROWS
    linear_module.MAX_BF16_WEIGHT_KERNEL_ROWS = kernel_rows
    try:
        start = time.perf_counter()
        for projection in projections:
            projection(inputs[projection.in_features])
        return (time.perf_counter() - start) * 1e3
    finally:
        linear_module.MAX_BF16_WEIGHT_KERNEL_ROWS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.unavailable_reason() is not None:
        raise SystemExit(f"C++ kernels unavailable: {native.unavailable_reason()}")
    shapes = projection_shapes(json.loads(args.config.read_text()))
    generator = torch.Generator().manual_seed(0)
    words: list[PackedLinear] = []
    dense: list[PackedLinear] = []
    for out_features, in_features in shapes:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).bfloat16()
        words.append(PackedLinear(weight.float()))
        # The float32 path as before: oneDNN's packed copy (no kernels for this one).
        dense.append(PackedLinear(weight.float(), use_block_codes=False))
        del weight
    word_bytes = sum(p.resident_bytes for p in words)
    dense_bytes = sum(p.resident_bytes for p in dense)
    print(
        f"{args.config.parent.name}: {len(shapes)} projections, {word_bytes / 1e6:.1f} MB as "
        f"bfloat16 words, {dense_bytes / 1e6:.1f} MB float32; kernels at "
        f"{native.loaded_level()}, {args.threads} threads, load {os.getloadavg()[0]:.2f}"
    )
    print(
        "| rows | float32 oneDNN ms | bf16 words, kernel ms | bf16 words widened + oneDNN ms "
        "| kernel speed-up | GB/s oneDNN / kernel |"
    )
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator) for _, k in shapes}
        best = {"dense": float("inf"), "kernel": float("inf"), "widened": float("inf")}
        for _ in range(args.rounds):
            best["dense"] = min(best["dense"], pass_ms(dense, inputs))
            best["kernel"] = min(best["kernel"], pass_ms(words, inputs))
            best["widened"] = min(best["widened"], pass_ms(words, inputs, kernel_rows=0))
        print(
            f"| {rows} | {best['dense']:.1f} | {best['kernel']:.1f} | {best['widened']:.1f} | "
            f"{best['dense'] / best['kernel']:.2f}x | {dense_bytes / best['dense'] / 1e6:.1f} / "
            f"{word_bytes / best['kernel'] / 1e6:.1f} |",
            flush=True,
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
