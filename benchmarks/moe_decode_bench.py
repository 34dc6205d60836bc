"""Decode steps of a MoE checkpoint in process: the fused expert kernel (with
bfloat16 experts where the checkpoint's weights are bfloat16) against the
grouped path over float32 experts, the rest of the model the same.

Two ModelRunners of one checkpoint (default: benchmarks/family_checkpoint.py's
Qwen3-MoE folder, float32 compute) each prefill ``--batch`` random
``--context``-token prompts (untimed), then run decode steps one after the
other, alternating, each step timed on the process's CPU-time clock
(``time.process_time``: both torch threads' time, not other processes').
Prints the median and best step of each and their ratio. Usage: ``python
benchmarks/moe_decode_bench.py [--model /tmp/bench-qwen3-moe] [--batch 16]
[--steps 16]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import decoder

GREEDY = SamplingParams(temperature=0.0)


def make_runner(model: Path, fused: bool, threads: int | None) -> ModelRunner:
    """A runner whose MoE layers run fused (experts packed in panels, bfloat16
    words where exact) or grouped over float32 experts (left unpacked: the
    path before the fused kernel)."""
    pack = decoder.DecoderLayer.pack_experts
    if not fused:
        decoder.DecoderLayer.pack_experts = lambda self: None  # type: ignore[method-assign]
    try:
        return ModelRunner(
            ModelConfig.from_pretrained(model),
            CacheConfig(block_size=16, num_kv_blocks=512),
            num_threads=threads,
        )
    finally:
        decoder.DecoderLayer.pack_experts = pack  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/bench-qwen3-moe"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    runners = {"fused": make_runner(args.model, True, args.threads)}
    runners["grouped"] = make_runner(args.model, False, args.threads)
    layer = runners["fused"].model.layers[0]
    print(
        f"{args.model}: batch {args.batch}, context {args.context}, "
        f"{torch.get_num_threads()} threads, fused experts {layer.experts_gate_up.dtype}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, runners["fused"].vocab_size, (args.batch, args.context), generator=generator
    ).tolist()
    drivers = {}
    for name, runner in runners.items():
        driver = LocalDriver(runner)
        for index, prompt in enumerate(prompts):
            driver.add_request(f"{name}-{index}", prompt, GREEDY, args.steps + 4)
        driver.step()  # prefill
        driver.step()  # a warm-up decode step
        drivers[name] = driver
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.steps):
        for name, driver in drivers.items():
            start = time.process_time()
            driver.step()
            times[name].append((time.process_time() - start) * 1e3)
    for name, steps in times.items():
        print(f"{name:8s} median {statistics.median(steps):7.1f} ms  best {min(steps):7.1f} ms")
    ratio = statistics.median(times["grouped"]) / statistics.median(times["fused"])
    print(f"grouped / fused (medians): {ratio:.2f}x  (CPU ms per step, all threads)")


if __name__ == "__main__":
    main()
