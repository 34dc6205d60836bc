"""Small-batch projections: oneDNN (float32 or bf16) vs the C++ kernels over exact
block codes and (bfloat16 at the avx512_bf16 level) over feature-pair-packed weights.

Runs every projection of the default model (30 layers x qkv/o/gate_up/down,
plus the LM head) once per "step", in model order, as a decode step does, so
that the weights stream from memory rather than sit in cache; prints
milliseconds per step for each path and batch size and the ratio, measured in
this run. Usage: ``python benchmarks/linear_bench.py [--rows 1 16 32 64]
[--dtype bfloat16]`` (bfloat16: oneDNN's bf16 kernels against the codes
kernel fed bf16 rows, as the bf16 model runs them).

The crossover it shows is what ``MAX_BLOCK_CODE_ROWS`` (and ``_BF16``,
``_BF16_DOT``, ``_BF16_AMX``), ``MIN_PAIR_ROWS_OVER_CODES`` and ``MAX_PAIR_ROWS`` in
worker/models/linear.py are set from; the kernels run at the loaded
instruction-set level (``KVMESH_CPU_ISA``, printed). The paths alternate within
each of ``--rounds`` rounds (the best round counts), so a drift of the host's
speed hits them alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvmesh.worker.models.linear as linear_module
from kvmesh.kernels import native
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.model_loader import load_model
from kvmesh.worker.models.linear import PackedLinear

CODE_ROW_LIMITS = (
    "MAX_BLOCK_CODE_ROWS",
    "MAX_BLOCK_CODE_ROWS_BF16",
    "MAX_BLOCK_CODE_ROWS_BF16_DOT",
    "MAX_BLOCK_CODE_ROWS_BF16_AMX",
)


def pass_ms(projections: list[PackedLinear], inputs: dict[int, torch.Tensor], force: str) -> float:
    """One pass over every projection; ``force`` picks the path ("onednn",
    "codes" or "pairs")."""
    limits = {name: 1 << 30 if force == "codes" else 0 for name in CODE_ROW_LIMITS}
    limits["MIN_PAIR_ROWS_OVER_CODES"] = 1
    limits["MAX_PAIR_ROWS"] = 1 << 30 if force == "pairs" else 0
    saved = {name: getattr(linear_module, name) for name in limits}
    for name, value in limits.items():
        setattr(linear_module, name, value)
    try:
        start = time.perf_counter()
        for projection in projections:
            projection(inputs[projection.in_features])
        return (time.perf_counter() - start) * 1e3
    finally:
        for name, value in saved.items():
            setattr(linear_module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_pretrained(default_model_path(), dtype=args.dtype)
    model = load_model(config)
    projections = [p for layer in model.layers for p in layer._packed.values()]
    projections.append(model._packed_lm_head)
    with_codes, total = model.block_code_coverage()
    threads = torch.get_num_threads()
    level = native.loaded_level()
    print(
        f"{with_codes}/{total} projections have exact block codes; {threads} threads; "
        f"oneDNN in {args.dtype}; C++ kernels at the {level.name if level else None} level"
    )
    paths = ["onednn", "codes"]
    if any(p._pairs is not None for p in projections):
        paths.append("pairs")
    print(f"{'rows':>5} " + " ".join(f"{path + ' ms':>10}" for path in paths) + "  (best round)")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {
                n: torch.randn(rows, n, dtype=config.dtype)
                for n in {p.in_features for p in projections}
            }
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds):
                for path in paths:
                    best[path] = min(best[path], pass_ms(projections, inputs, path))
            ratios = ", ".join(f"{path} {best['onednn'] / best[path]:.2f}x" for path in paths[1:])
            times = " ".join(f"{best[path]:>10.2f}" for path in paths)
            print(f"{rows:>5} {times}  oneDNN / {ratios}")


if __name__ == "__main__":
    main()
