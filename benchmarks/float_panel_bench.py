"""float32 projections: the kernels' float32 panels (``float_panel_linear``: a
panel loop for small batches, a cache-blocked GEMM from 32 rows on the avx2
level) against oneDNN's prepacked copy (what PackedLinear kept before) and
``torch.mm`` (what ``nn.Linear`` and sentence-transformers run), plus the
bfloat16-word panels of the same weights.

Six projection shapes, a Qwen3 layer's (1,024 -> 4,096 / 6,144, 3,072 -> 1,024)
and a BERT-base layer's (768 -> 2,304 / 3,072, 3,072 -> 768), random weights.
Prints ms per pass over the six and GFLOP/s per path at each row count; the
paths alternate within each of ``--rounds`` rounds and the best round counts.

    python benchmarks/float_panel_bench.py [--rows 1 16 256 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.kernels import native
from kvmesh.kernels.bf16_weights import pack_float_panels, pack_panels

# (in_features, out_features)
SHAPES = ((1024, 4096), (1024, 6144), (3072, 1024), (768, 2304), (768, 3072), (3072, 768))


def _paths(rows: int) -> tuple[dict[str, Callable[[], object]], float]:
    """Each path's pass over the six shapes at ``rows`` rows, and the pass's GFLOP."""
    gen = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, k, generator=gen) for k, n in SHAPES]
    xs = [torch.randn(rows, k, generator=gen) for k, _ in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    floats = [pack_float_panels(w) for w in weights]
    words = [pack_panels(w.bfloat16().float()) for w in weights]
    outs = [n for _, n in SHAPES]
    paths: dict[str, Callable[[], object]] = {
        "oneDNN prepacked": lambda: [
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            for x, p in zip(xs, onednn, strict=True)
        ],
        "torch.mm": lambda: [torch.mm(x, w.t()) for x, w in zip(xs, weights, strict=True)],
        "float32 panels": lambda: [
            torch.ops.kvmesh.float_panel_linear(x, p, None, n)
            for x, p, n in zip(xs, floats, outs, strict=True)
        ],
        "bf16-word panels": lambda: [
            torch.ops.kvmesh.bf16_weight_linear(x, p, None, n)
            for x, p, n in zip(xs, words, outs, strict=True)
        ],
    }
    gflop = sum(2 * rows * k * n for k, n in SHAPES) / 1e9
    return paths, gflop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    native.ensure_loaded()
    torch.set_num_threads(args.threads)
    level = native.loaded_level()
    print(f"kernels: {level.name if level else None}; threads {args.threads}")
    print("rows | " + " | ".join(_paths(1)[0]) + "  (ms per pass, GFLOP/s)")
    for rows in args.rows:
        paths, gflop = _paths(rows)
        best = dict.fromkeys(paths, float("inf"))
        for run in paths.values():
            run()  # warm-up: first-call allocations, oneDNN primitive caches
        for _ in range(args.rounds):
            for name, run in paths.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        cells = [f"{s * 1e3:.2f} ({gflop / s:.0f})" for s in best.values()]
        ratio = best["oneDNN prepacked"] / best["float32 panels"]
        print(f"{rows} | " + " | ".join(cells) + f"  panels/oneDNN {ratio:.2f}x")


if __name__ == "__main__":
    main()
