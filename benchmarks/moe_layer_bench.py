"""One MoE layer at decode and prefill sizes: where the grouped path's time goes,
and the grouped path against the fused C++ kernel (kernels/csrc/fused_moe_cpu.cpp).

The layer is benchmarks/family_checkpoint.py's Qwen3-MoE (hidden 768, 32 experts
of width 384, top-4 renormalized) with random weights, ``--layers`` copies of
it run one after the other per measurement, so that the experts' weights come
from memory as in a decode step (one layer's experts are 113 MB in float32)
rather than from cache.

Two tables:

- ``stages``: the grouped path (worker/models/moe.py's ``grouped_experts``)
  split into router (linear, softmax, top-k), sort (argsort, bincount, gather),
  gate_up (``_grouped_mm``), activation, down (``_grouped_mm``) and combine
  (routing weights, ``index_add_``).
- ``paths``: grouped against fused, over float32 expert weights and (the
  fused kernel only) bfloat16 ones, ms per layer (the fused kernel's panels
  packed once, before timing, as a layer packs them at load).

Times are the process's CPU time (``time.process_time``: every thread's, so a
2-thread op's time is about twice its wall time, and another process's load
does not count), the variants alternating within each of ``--rounds`` rounds,
best round kept. Usage: ``python benchmarks/moe_layer_bench.py [--tokens 1 4
16 64] [--rounds 5] [--layers 4] [--threads 1]`` (one thread: no time spent
waiting for a descheduled sibling thread on a loaded box).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.kernels import native
from kvmesh.worker.models import moe

HIDDEN, EXPERTS, WIDTH, TOP_K = 768, 32, 384, 4


def make_layers(count: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """(router, gate_up, down) per layer, scaled so the activations stay O(1)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return [
        (
            randn(EXPERTS, HIDDEN, scale=0.1),
            randn(EXPERTS, 2 * WIDTH, HIDDEN, scale=HIDDEN**-0.5),
            randn(EXPERTS, HIDDEN, WIDTH, scale=WIDTH**-0.5),
        )
        for _ in range(count)
    ]


def grouped_stages(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> dict[str, float]:
    """grouped_experts, step by step, each stage's CPU seconds."""
    times: dict[str, float] = {}
    clock = time.process_time()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.process_time()
        times[name] = now - clock
        clock = now

    weights, experts = moe.route(x, router, TOP_K, True)
    lap("router")
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // TOP_K
    counts = torch.bincount(flat, minlength=EXPERTS)
    grouped = x[tokens]
    ends = torch.cumsum(counts, 0).to(torch.int32)
    lap("sort")
    projected = torch._grouped_mm(grouped, gate_up.transpose(1, 2), offs=ends)
    lap("gate_up")
    gate, up = projected.chunk(2, dim=-1)
    activated = F.silu(gate) * up
    lap("activation")
    out = torch._grouped_mm(activated, down.transpose(1, 2), offs=ends)
    lap("down")
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    x.new_zeros(x.shape).index_add_(0, tokens, out)
    lap("combine")
    return times


def cpu_ms(fn: Callable[[], object], layers: int) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) / layers * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native.ensure_loaded()
    print(
        f"level {native.loaded_level().name}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    float_layers = make_layers(args.layers, torch.float32)
    float_panels = [(r, *moe.pack_expert_panels(g, d, torch.float32)) for r, g, d in float_layers]
    bf16_panels = [(r, *moe.pack_expert_panels(g, d, torch.bfloat16)) for r, g, d in float_layers]
    generator = torch.Generator().manual_seed(1)

    print("\nstages of the grouped path, CPU ms per layer (best round)")
    names = ("router", "sort", "gate_up", "activation", "down", "combine")
    print("tokens " + " ".join(f"{n:>10}" for n in names) + "      total")
    for count in args.tokens:
        x = torch.randn(count, HIDDEN, generator=generator)
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            sums = dict.fromkeys(names, 0.0)
            for layer in float_layers:
                for name, seconds in grouped_stages(x, *layer).items():
                    sums[name] += seconds
            for name in names:
                best[name] = min(best[name], sums[name] / args.layers * 1e3)
        row = " ".join(f"{best[n]:10.2f}" for n in names)
        print(f"{count:6d} {row} {sum(best.values()):10.2f}")

    print("\npaths, CPU ms per layer (best round); alternating within each round")
    print("tokens    grouped  fused f32  fused bf16w  grouped/fused")
    for count in args.tokens:
        x = torch.randn(count, HIDDEN, generator=generator)

        def grouped(x: torch.Tensor = x) -> None:
            for router, gate_up, down in float_layers:
                moe.grouped_experts(x, router, gate_up, down, TOP_K, True)

        def fused(layers: list[tuple[torch.Tensor, ...]], x: torch.Tensor = x) -> None:
            for router, gate_up, down in layers:
                moe.fused_experts(x, router, gate_up, down, TOP_K, True)

        variants = {
            "grouped": grouped,
            "fused": lambda: fused(float_panels),
            "fused_bf16": lambda: fused(bf16_panels),
        }
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(args.rounds):
            for name, fn in variants.items():
                best[name] = min(best[name], cpu_ms(fn, args.layers))
        print(
            f"{count:6d} {best['grouped']:10.2f} {best['fused']:10.2f} "
            f"{best['fused_bf16']:12.2f} {best['grouped'] / best['fused']:13.2f}x"
        )


if __name__ == "__main__":
    main()
