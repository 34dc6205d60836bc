"""Cost of one decode step's sampling, per sampling setting, against greedy.

The worker's sampler (``runner.sampler``, the one a decode step calls) samples
the real default model's decode logits (captured from a decode step of the
ModelRunner on ~128-token prompts) at batch 1, 16 and 64, for what clients send:
greedy, temperature 1 (no parameters given), top-k 50, temperature 0.7 +
top-p 0.9, min-p 0.05 and penalties (repetition 1.1, presence 0.5, frequency
0.5) over a history of 128 prompt + 64 output tokens per row. ``--logits flat``
samples standard normal logits instead (a random-weight model's flat rows,
whose top-p nuclei hold thousands of tokens: top_p's worst case). Each timing
is the fastest of ``--reps`` calls (on a shared machine the least disturbed
one) of what ``ModelRunner._sample`` does for a decode step whose rows are the
previous step's: the cached request columns (``SamplingColumnsCache``) plus
the step's part of the metadata (``step_sampling_metadata``), then sample.
The same run measures the decode step's forward at each batch, so the cost
over greedy is also printed as a share of the step.

    python -m benchmarks.sampler_step [--reps 30] [--threads 2] [--logits real,flat]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.engine_bench import CONTEXT_LEN, runner_decode_rate
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.sampler import SamplerOutput
from kvmesh.worker.sampling_metadata import (
    SamplingColumnsCache,
    SamplingMetadata,
    gather_request_columns,
    step_sampling_metadata,
)

BATCH_SIZES = (1, 16, 64)
SETTINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "T 0.7 + top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "min-p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "penalties": SamplingParams(
        temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
}
OUTPUT_LEN = 64


def capture_decode_logits(runner: ModelRunner, batch_size: int) -> tuple[torch.Tensor, float]:
    """One decode step's logits at ``batch_size`` and the mean forward time per step (s)."""
    captured: list[torch.Tensor] = []
    sampler = runner.sampler

    def capturing(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        captured.append(logits.detach().clone())
        return sampler(logits, metadata)

    runner.sampler = capturing  # type: ignore[assignment]
    try:
        _, timings = runner_decode_rate(runner, batch_size, steps=2)
    finally:
        runner.sampler = sampler
    decode = [logits for logits in captured if logits.shape[0] == batch_size]
    return decode[-1].float().contiguous(), timings.forward / timings.num_steps


def fastest_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def sample_step(runner: ModelRunner, logits: torch.Tensor, params: SamplingParams) -> Callable:
    rows = logits.shape[0]
    vocab = logits.shape[1]
    rng = np.random.default_rng(rows)
    num_tokens = np.full(rows, CONTEXT_LEN + OUTPUT_LEN, dtype=np.int64)
    prompt_lens = np.full(rows, CONTEXT_LEN, dtype=np.int64)
    token_ids = rng.integers(3, vocab, (rows, CONTEXT_LEN + OUTPUT_LEN + 1)).astype(np.int32)
    eos = runner.model_config.eos_token_ids
    cache = SamplingColumnsCache()

    def step() -> object:
        columns, generators = cache.get(
            "unchanged rows", lambda: (gather_request_columns([params] * rows, eos, vocab), {})
        )
        metadata = step_sampling_metadata(
            columns, token_ids, prompt_lens, num_tokens, generators, vocab
        )
        return runner.sampler(logits, metadata).token_ids

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--logits",
        default="real",
        help="comma-separated: real (a decode step's), flat (standard normal)",
    )
    args = parser.parse_args()
    kinds = args.logits.split(",")
    if not set(kinds) <= {"real", "flat"}:
        parser.error(f"--logits: real and/or flat, got {args.logits}")
    model_path = default_model_path()
    model_config = ModelConfig.from_pretrained(model_path, max_model_len=CONTEXT_LEN + 64)
    blocks = cdiv(CONTEXT_LEN + 16, 16) * max(BATCH_SIZES) + 16
    runner = ModelRunner(model_config, CacheConfig(num_kv_blocks=blocks), num_threads=args.threads)
    print(
        f"{model_path.name}: vocabulary {runner.vocab_size}, {torch.get_num_threads()} threads, "
        f"sampler {type(runner.sampler).__name__} {vars(runner.sampler)}"
    )
    header = f"{'setting':<20}" + "".join(f"| b={b:<3} ms  +greedy  %step " for b in BATCH_SIZES)
    results: dict[tuple[str, int], dict[str, float]] = {}
    steps: dict[int, float] = {}
    for batch_size in BATCH_SIZES:
        real, steps[batch_size] = capture_decode_logits(runner, batch_size)
        for kind in kinds:
            logits = real
            if kind == "flat":
                generator = torch.Generator().manual_seed(batch_size)
                logits = torch.randn(real.shape, generator=generator)
            torch.manual_seed(0)
            results[kind, batch_size] = {
                name: fastest_seconds(sample_step(runner, logits, params), args.reps)
                for name, params in SETTINGS.items()
            }
    print(
        "decode forward per step: "
        + ", ".join(f"batch {b}: {steps[b] * 1e3:.1f} ms" for b in BATCH_SIZES)
    )
    for kind in kinds:
        print(f"{kind} logits")
        print(header)
        for name in SETTINGS:
            line = f"{name:<20}"
            for batch_size in BATCH_SIZES:
                cost = results[kind, batch_size][name]
                extra = cost - results[kind, batch_size]["greedy"]
                share = extra / steps[batch_size]
                line += f"| {cost * 1e3:8.3f}  {extra * 1e3:+7.3f}  {share:+6.1%} "
            print(line)


if __name__ == "__main__":
    main()
