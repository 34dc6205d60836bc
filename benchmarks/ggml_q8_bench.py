"""GGUF blocks at decode batch sizes: every way kvmesh multiplies them, kernel alone.

One SmolLM2-135M layer's projections in llama.cpp's own type choice for each
mix (576-wide rows: Q4_K_M's Q5_0, Q8_0's Q8_0; ffn_down's 1,536-wide rows:
Q6_K / Q8_0), random blocks, per batch size, through:

- ``float``: ``ggml_linear`` (each row rebuilt to float32, float dot products);
- ``int8 rows``: ``ggml_linear_q8`` (activations quantized to int8 per 32
  features, codes unpacked in registers per 4 rows of x);
- ``int8 panel``: ``ggml_linear_q8_panel`` (the same arithmetic, codes unpacked
  once per call into an L1 panel that every row of x reads);
- ``float gemm``: ``ggml_float_gemm`` (each k slice of 16-row panels
  dequantized once per call into float32 panels in L2, the blocked GEMM's
  6 x 16 micro-kernel over every row of x);
- ``tiles``: a tile of rows rebuilt to float32 and oneDNN's GEMM
  (``GGMLLinear.linear_by_tiles``, the prefill path);
- ``dispatch``: ``GGMLLinear`` with ``--quantization w8a8``, which picks one
  of the above by batch size (kernels/ggml_blocks.py, worker/models/ggml_linear.py).

Times are the process's CPU time (all threads together: on a shared box the
CPU clock does not count the time other processes hold the cores; with 2
threads it also counts their spin-waits) with the wall time beside it, the
median over ``--rounds`` rounds that run every way once each in turn, so a
change of load hits them all alike. One layer (2.6-3.8 MB) stays in the
last-level cache between rounds: this measures the kernels' arithmetic, not
memory; benchmarks/decode_bandwidth.py measures whole steps.

    python -m benchmarks.ggml_q8_bench [--threads 1] [--rounds 30] [--batches 1 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from kvmesh.kernels import native
from kvmesh.kernels.ggml_blocks import GGMLRows, Segment
from kvmesh.services.runtime.cpu_features import CpuFeatures
from kvmesh.worker.models.ggml_linear import GGMLLinear
from tests.kernels.test_kernels_ggml_blocks import _random_blocks

Q = GGMLQuantizationType
HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
# (type, rows, width) per layer: q, k, v, o, gate, up in one run of rows; ffn_down.
LAYERS = {
    "Q4_K_M": ((Q.Q5_0, 2 * HIDDEN + 2 * KV + 2 * INTERMEDIATE, HIDDEN), (Q.Q6_K, HIDDEN, 1536)),
    "Q8_0": ((Q.Q8_0, 2 * HIDDEN + 2 * KV + 2 * INTERMEDIATE, HIDDEN), (Q.Q8_0, HIDDEN, 1536)),
}
Way = Callable[[torch.Tensor], torch.Tensor]


def ways(rows: GGMLRows) -> dict[str, Way]:
    blocks, kinds = [s.blocks for s in rows.segments], [int(s.kind) for s in rows.segments]
    dispatch = GGMLLinear(rows, None, torch.float32, int8_activations=True)
    return {
        "float": lambda x: torch.ops.kvmesh.ggml_linear(x, blocks, kinds),
        "int8 rows": lambda x: torch.ops.kvmesh.ggml_linear_q8(x, blocks, kinds),
        "int8 panel": lambda x: torch.ops.kvmesh.ggml_linear_q8_panel(x, blocks, kinds),
        "float gemm": lambda x: torch.ops.kvmesh.ggml_float_gemm(x, blocks, kinds),
        "tiles": dispatch.linear_by_tiles,
        "dispatch": dispatch,
    }


def seconds(way: Way, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """CPU seconds and wall seconds per call."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        way(x)
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def measure(
    layer: list[tuple[dict[str, Way], int]], batch: int, rounds: int
) -> dict[str, tuple[float, float]]:
    """Median (CPU, wall) seconds per layer pass of each way, rounds alternating between ways."""
    xs = [torch.randn(batch, width) for _, width in layer]
    names = list(layer[0][0])
    calls = max(1, 16 // batch)  # a few ms per sample at small batches
    for (by_name, _), x in zip(layer, xs, strict=True):
        for way in by_name.values():
            way(x)  # warm-up: thread-local buffers, oneDNN's primitive cache
    cpu: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            parts = [
                seconds(by_name[name], x, calls) for (by_name, _), x in zip(layer, xs, strict=True)
            ]
            cpu[name].append(sum(c for c, _ in parts))
            wall[name].append(sum(w for _, w in parts))
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = parser.parse_args(argv)
    if (reason := native.unavailable_reason()) is not None:
        raise SystemExit(f"the C++ kernels are needed: {reason}")
    torch.set_num_threads(args.threads)
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}; ms of process CPU time per layer pass"
    )
    for mix, parts in LAYERS.items():
        layer = []
        for kind, n, width in parts:
            blocks = torch.from_numpy(_random_blocks(kind, n, width, 0))
            layer.append((ways(GGMLRows((Segment(kind, blocks),), width)), width))
        for batch in args.batches:
            result = measure(layer, batch, args.rounds)
            ms = {name: cpu * 1e3 for name, (cpu, _) in result.items()}
            best = min((n for n in ms if n != "dispatch"), key=ms.__getitem__)
            print(
                f"{mix} batch {batch:3d}: "
                + "; ".join(
                    f"{name} {cpu * 1e3:.3f} ({wall * 1e3:.3f} wall)"
                    for name, (cpu, wall) in result.items()
                )
                + f"; fastest {best}; panel vs rows {ms['int8 rows'] / ms['int8 panel']:.2f}x",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
