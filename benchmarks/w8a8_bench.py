"""W8A8 (``--quantization w8a8``) against weight-only int8, same codes, same process.

Loads the default model with ``--quantization int8`` and times one pass over
every decoder projection (model order, best of 3) at each row count:

* int8 weight-only as it runs (the bfloat16/float32 code kernels up to
  ``MAX_CODES_ONLY_KERNEL_ROWS*``, rebuild + oneDNN above);
* int8 weight-only forced onto rebuild + oneDNN (the prefill path);
* W8A8 forced onto kernels/csrc/int8_linear.cpp (per-token int8 activations,
  vpdpbusd below 16 rows, AMX-INT8 tiles from 16 at the amx level).

What ``MAX_W8A8_KERNEL_ROWS`` and its ``_BF16`` variant are set from.

    python benchmarks/w8a8_bench.py [--rows 1 16 64 512 2048] [--dtype bfloat16] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvmesh.worker.models.linear as linear_module
from benchmarks.quant_prefill_bench import forced_ms, pass_ms
from kvmesh.kernels import native
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.dtype_choice import CpuFeatures
from kvmesh.worker.model_loader import load_model
from kvmesh.worker.models.linear import PackedLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9, help="rounds (a third from 512 rows)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_pretrained(default_model_path(), args.dtype, quantization="int8")
    model = load_model(config)
    int8 = [p for layer in model.layers for p in (layer._packed or {}).values()]
    assert all(p.codes_only for p in int8)
    w8a8 = [
        PackedLinear.from_codes(p.codes, p._bias, dtype, int8_activations=True)  # type: ignore[arg-type]
        for p in int8
    ]
    linear_module.MAX_W8A8_KERNEL_ROWS = linear_module.MAX_W8A8_KERNEL_ROWS_BF16 = 1 << 30
    cpu = CpuFeatures.detect()
    level = native.loaded_level()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {torch.get_num_threads()} threads, "
        f"kernels at the {level.name if level else None} level, {args.dtype}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print("| rows | int8 as it runs (ms) | int8 rebuild + oneDNN (ms) | w8a8 (ms) | int8 / w8a8 |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        inputs = {
            p.in_features: torch.randn(rows, p.in_features, generator=g).to(dtype) for p in int8
        }
        # Interleaved, best of each: a neighbour's burst slows one round, not one column.
        best = [float("inf")] * 3
        for _ in range(args.repeats if rows < 512 else max(2, args.repeats // 3)):
            times = (
                pass_ms(int8, inputs, repeats=1),
                forced_ms(int8, inputs, kernel=False, repeats=1),
                pass_ms(w8a8, inputs, repeats=1),
            )
            best = [min(b, t) for b, t in zip(best, times, strict=True)]
        as_runs, rebuild, quantized = best
        print(
            f"| {rows} | {as_runs:.1f} | {rebuild:.1f} | {quantized:.1f} | "
            f"{as_runs / quantized:.2f} |",
            flush=True,
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
