"""Decode throughput of the worker's ModelRunner vs transformers, in one process.

Usage: .venv/bin/python benchmarks/engine_bench.py [--model PATH] [--steps N]

For each batch size the runner first prefills ~128-token prompts (untimed),
then runs N decode steps; tokens/s = batch * N / seconds. The baseline is
transformers' ``generate`` (greedy, static batch of 16, KV cache on) on the same
checkpoint; its decode rate excludes prefill by differencing two runs. The
roofline is the weight bytes read once per decode step at the machine's
memory bandwidth (``--bandwidth-gbs``).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner, StepTimings

logger = logging.getLogger(__name__)

CONTEXT_LEN = 128
GREEDY = SamplingParams(temperature=0.0)


def _prompts(batch_size: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch_size)
    return torch.randint(3, vocab_size, (batch_size, CONTEXT_LEN), generator=generator).tolist()


def runner_decode_rate(
    runner: ModelRunner, batch_size: int, steps: int
) -> tuple[float, StepTimings]:
    driver = LocalDriver(runner)
    for index, prompt in enumerate(_prompts(batch_size, runner.vocab_size)):
        driver.add_request(f"b{batch_size}-{index}", prompt, GREEDY, steps + 2)
    driver.step()  # prefill every prompt, sample the first token
    driver.step()  # one warm-up decode
    runner.timings = StepTimings()
    started = time.perf_counter()
    for _ in range(steps):
        driver.step()
    elapsed = time.perf_counter() - started
    driver.run()
    return batch_size * steps / elapsed, runner.timings


def hf_decode_rate(model_path: Path, batch_size: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    input_ids = torch.tensor(_prompts(batch_size, model.config.vocab_size))

    def generate(num_new: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
            )
        return time.perf_counter() - started

    generate(2)  # warm-up
    prefill_only = generate(1)
    full = generate(steps + 1)
    return batch_size * steps / (full - prefill_only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--bandwidth-gbs", type=float, default=13.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention-backend", default=None)
    args = parser.parse_args()

    model_config = ModelConfig.from_pretrained(args.model, max_model_len=CONTEXT_LEN + 64)
    blocks_per_seq = cdiv(CONTEXT_LEN + args.steps + 4, 16)
    cache_config = CacheConfig(num_kv_blocks=max(args.batch_sizes) * blocks_per_seq + 16)
    runner = ModelRunner(
        model_config,
        cache_config,
        attention_backend=args.attention_backend,
        num_threads=args.threads,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    roofline = args.bandwidth_gbs * 1e9 / weight_bytes
    print(
        f"model {args.model.name}: {weight_bytes / 1e6:.0f} MB of weights, "
        f"backend {runner.backend.name}, {torch.get_num_threads()} threads; "
        f"one decode step per {1e3 / roofline:.1f} ms at {args.bandwidth_gbs} GB/s"
    )
    rates: dict[int, float] = {}
    for batch_size in args.batch_sizes:
        rate, timings = runner_decode_rate(runner, batch_size, args.steps)
        rates[batch_size] = rate
        per_step = 1e3 / timings.num_steps
        print(
            f"runner  batch {batch_size:3d}: {rate:7.1f} tok/s  "
            f"({rate / (roofline * batch_size):.0%} of the bandwidth bound for this batch); "
            f"per step: prepare {timings.prepare * per_step:.2f} ms, "
            f"forward {timings.forward * per_step:.2f} ms, "
            f"sample {timings.sample * per_step:.2f} ms"
        )
    hf_rate = hf_decode_rate(args.model, args.hf_batch_size, args.steps)
    print(f"transformers generate batch {args.hf_batch_size}: {hf_rate:7.1f} tok/s")
    for batch_size, rate in rates.items():
        print(
            f"ratio runner@{batch_size} / transformers@{args.hf_batch_size}: {rate / hf_rate:.2f}x"
        )


if __name__ == "__main__":
    main()
