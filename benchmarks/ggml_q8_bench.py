"""GGUF blocks at decode batch sizes: float activations vs int8 ones, kernel alone.

One SmolLM2-135M layer's projections in llama.cpp's own type choice for each
mix (576-wide rows: Q4_K_M's Q5_0, Q8_0's Q8_0; ffn_down's 1,536-wide rows:
Q6_K / Q8_0), random blocks, through ``ggml_linear`` (each row rebuilt to
float32, float dot products) and ``ggml_linear_q8`` (activations quantized to
int8 per 32 features, integer dot products): best-of-``--rounds`` ms per
layer pass and the weight GB/s that makes, per batch size. One layer (2.6-3.8
MB) stays in the last-level cache between rounds: this measures the kernels'
arithmetic, not memory; benchmarks/decode_bandwidth.py measures whole steps.

    python -m benchmarks.ggml_q8_bench [--threads 1] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from gguf import GGMLQuantizationType

from kvmesh.kernels import native
from kvmesh.services.runtime.cpu_features import CpuFeatures
from tests.kernels.test_kernels_ggml_blocks import _random_blocks

Q = GGMLQuantizationType
HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
# (type, rows, width) per layer: q, k, v, o, gate, up in one run of rows; ffn_down.
LAYERS = {
    "Q4_K_M": ((Q.Q5_0, 2 * HIDDEN + 2 * KV + 2 * INTERMEDIATE, HIDDEN), (Q.Q6_K, HIDDEN, 1536)),
    "Q8_0": ((Q.Q8_0, 2 * HIDDEN + 2 * KV + 2 * INTERMEDIATE, HIDDEN), (Q.Q8_0, HIDDEN, 1536)),
}


def best_seconds(op, x: torch.Tensor, blocks: torch.Tensor, kind: int, rounds: int) -> float:
    op(x, [blocks], [kind])
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        op(x, [blocks], [kind])
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args(argv)
    if (reason := native.unavailable_reason()) is not None:
        raise SystemExit(f"the C++ kernels are needed: {reason}")
    torch.set_num_threads(args.threads)
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    ops = {"float": torch.ops.kvmesh.ggml_linear, "int8": torch.ops.kvmesh.ggml_linear_q8}
    for mix, parts in LAYERS.items():
        pieces = [(torch.from_numpy(_random_blocks(k, n, w, 0)), int(k), w) for k, n, w in parts]
        nbytes = sum(blocks.numel() for blocks, _, _ in pieces)
        for batch in args.batches:
            seconds = {}
            for name, op in ops.items():
                seconds[name] = sum(
                    best_seconds(op, torch.randn(batch, width), blocks, kind, args.rounds)
                    for blocks, kind, width in pieces
                )
            print(
                f"{mix} batch {batch:3d}: {nbytes / 1e6:.2f} MB per layer; "
                + "; ".join(
                    f"{name} {s * 1e3:.3f} ms ({nbytes / s / 1e9:.1f} GB/s)"
                    for name, s in seconds.items()
                )
                + f"; int8 {seconds['float'] / seconds['int8']:.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
