"""Prefill-sized projections: codes-only weights (rebuilt per call) vs prepacked float32.

A GGUF file's (or --quantization int8's) projections keep only their codes;
above ``MAX_BLOCK_CODE_ROWS`` rows each call rebuilds the float32 weight into
a scratch buffer and runs oneDNN on it. This runs every decoder projection of
the default model once per pass, in model order, for both holdings, and prints
milliseconds per pass (best of 3), the ratio, and the rebuilding alone.

``--kernel-crossover`` instead times the codes-only projections on the C++
kernel against rebuilding + oneDNN, both forced, at each row count, in
``--dtype`` (what ``MAX_CODES_ONLY_KERNEL_ROWS`` and its ``_BF16_AMX``
variant are set from).

    python benchmarks/quant_prefill_bench.py [--rows 64 512 2048] [--threads N]
    python benchmarks/quant_prefill_bench.py --kernel-crossover --dtype bfloat16 --rows 64 128 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.kernels import native
from kvmesh.services.runtime.model_prep import _find_gguf, default_model_path
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.dtype_choice import CpuFeatures
from kvmesh.worker.model_loader import load_model
from kvmesh.worker.models.linear import PackedLinear, _dequantize


def decoder_projections(path: Path, dtype: str | None = None) -> list[PackedLinear]:
    model = load_model(ModelConfig.from_pretrained(path, dtype=dtype))
    return [p for layer in model.layers for p in (layer._packed or {}).values()]


def best_ms(work, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def pass_ms(
    projections: list[PackedLinear], inputs: dict[int, torch.Tensor], repeats: int = 3
) -> float:
    """Best time of one pass over ``projections`` in order."""
    with torch.inference_mode():
        return best_ms(lambda: [p(inputs[p.in_features]) for p in projections], repeats)


def forced_ms(
    projections: list[PackedLinear],
    inputs: dict[int, torch.Tensor],
    kernel: bool,
    repeats: int = 3,
) -> float:
    """``pass_ms`` with codes-only projections forced onto the kernel or off it."""
    import kvmesh.worker.models.linear as linear_module

    names = ("MAX_CODES_ONLY_KERNEL_ROWS", "MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX")
    saved = [getattr(linear_module, name) for name in names]
    for name in names:
        setattr(linear_module, name, 1 << 30 if kernel else 0)
    try:
        return pass_ms(projections, inputs, repeats)
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(linear_module, name, value)


def kernel_crossover(rows_list: list[int], dtype: str) -> None:
    codes = decoder_projections(_find_gguf(), dtype)
    level = native.loaded_level()
    print(f"C++ kernels at the {level.name if level else None} level; {dtype}")
    print("| rows | kernel (ms) | rebuild + oneDNN (ms) | ratio |")
    print("|---|---|---|---|")
    for rows in rows_list:
        inputs = {
            p.in_features: torch.randn(rows, p.in_features, dtype=getattr(torch, dtype))
            for p in codes
        }
        kernel_ms, rebuild_ms = forced_ms(codes, inputs, True), forced_ms(codes, inputs, False)
        print(f"| {rows} | {kernel_ms:.1f} | {rebuild_ms:.1f} | {kernel_ms / rebuild_ms:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernel-crossover", action="store_true")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="--kernel-crossover's"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.kernel_crossover:
        kernel_crossover(args.rows, args.dtype)
        return
    dense = decoder_projections(default_model_path())
    codes = decoder_projections(_find_gguf())
    assert all(p.codes_only for p in codes)
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {torch.get_num_threads()} threads, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    rebuild = best_ms(lambda: [_dequantize(p._codes) for p in codes])
    print(f"rebuilding every decoder weight once: {rebuild:.1f} ms")
    print("| rows | prepacked float32 (ms) | codes only (ms) | ratio |")
    print("|---|---|---|---|")
    for rows in args.rows:
        inputs = {p.in_features: torch.randn(rows, p.in_features) for p in dense}
        dense_ms, codes_ms = pass_ms(dense, inputs), pass_ms(codes, inputs)
        print(f"| {rows} | {dense_ms:.1f} | {codes_ms:.1f} | {codes_ms / dense_ms:.2f} |")


if __name__ == "__main__":
    main()
