"""Output throughput of kvmesh against its own engine and transformers, in one run.

Usage: .venv/bin/python benchmarks/baselines.py [--num-prompts 64] [--concurrency 16]

Same model, same prompts (``--num-prompts`` random token-id prompts of
``--input-len`` tokens), greedy, ``ignore_eos``, exactly ``--output-len``
tokens each, through:

  (a) the full stack over HTTP: ``kvmesh up`` on free ports, driven by the
      ``kvmesh bench`` client at ``--concurrency`` (and again at
      ``--concurrency-large``);
  (b) kvmesh's engine in process: Scheduler + ModelRunner, no services
      (kvmesh/engine.py), same concurrency;
  (c) transformers ``generate`` in static batches of ``--hf-batch-size``.

It prints output tokens/s of each, the ratios a/c and a/b, and the load
average next to every number: on a shared 2-core machine, a busy neighbour
changes everything, so read the numbers with it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvmesh.engine import InProcessEngine  # noqa: E402
from kvmesh.services.cli.bench.client import ClientConfig, CompletionsClient  # noqa: E402
from kvmesh.services.cli.bench.dataset import SampleRequest  # noqa: E402
from kvmesh.services.cli.bench.metrics import compute_metrics  # noqa: E402
from kvmesh.services.cli.bench.runner import LoadConfig, run_load  # noqa: E402
from kvmesh.services.cli.bench.sampling import GREEDY, SamplingSetting  # noqa: E402
from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402
from kvmesh.services.contracts.sampling_params import SamplingParams  # noqa: E402
from kvmesh.services.runtime.model_prep import default_model_path  # noqa: E402


@dataclass
class Measurement:
    label: str
    output_tokens: int
    seconds: float
    load_before: str
    load_after: str
    detail: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        return (
            f"{self.label:<44} {self.tokens_per_s:8.1f} output tok/s "
            f"({self.output_tokens} tokens in {self.seconds:.1f}s; "
            f"load {self.load_before} -> {self.load_after}) {self.detail}"
        )


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 up: no special tokens (bos/eos/pad) inside a random prompt.
    return torch.randint(3, vocab_size, (num_prompts, input_len), generator=generator).tolist()


# ---- (a) the full stack over HTTP ---------------------------------------------------


@dataclass(frozen=True)
class HttpRun:
    """One load run against an OpenAI-compatible server."""

    output_tokens: int
    seconds: float
    mean_ttft_ms: float
    mean_tpot_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def detail(self) -> str:
        return f"mean TTFT {self.mean_ttft_ms:.0f} ms, mean TPOT {self.mean_tpot_ms:.1f} ms"


async def http_run(
    url: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    sampling: SamplingSetting = GREEDY,
) -> HttpRun:
    """``prompts`` through ``url``'s /v1/completions at ``concurrency`` (after a
    2-request warm-up), sending ``sampling``'s fields (greedy unless told),
    exactly ``output_len`` tokens each."""
    requests = [
        SampleRequest(f"bench-{i}", prompt, len(prompt), output_len)
        for i, prompt in enumerate(prompts)
    ]
    config = ClientConfig(base_url=url, ignore_eos=True, sampling=sampling)
    async with CompletionsClient(config) as client:
        client.config = ClientConfig(
            base_url=url,
            model=await client.first_model_id(),
            ignore_eos=True,
            sampling=sampling,
            max_connections=concurrency,
        )
        # Warm-up: first requests pay for lazy initialisation in every service.
        # Reversed prompts: the measured prompts themselves would then be
        # prefix-cache hits on both servers (llama-server's slots keep them too).
        warm_up = [
            SampleRequest(f"warm-{r.request_id}", r.prompt[::-1], r.prompt_len, r.output_len)
            for r in requests[:2]
        ]
        await run_load(client.send, warm_up, LoadConfig(max_concurrency=2, show_progress=False))
        result = await run_load(
            client.send,
            requests,
            LoadConfig(request_rate=math.inf, max_concurrency=concurrency, show_progress=False),
        )
    failed = [o for o in result.outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    metrics = compute_metrics(result.outputs, result.duration_s, (50.0, 99.0))
    ttft, tpot = metrics.latencies.get("ttft"), metrics.latencies.get("tpot")
    return HttpRun(
        metrics.total_output_tokens,
        result.duration_s,
        ttft.mean_ms if ttft is not None else math.nan,
        tpot.mean_ms if tpot is not None else math.nan,
    )


def measure_stack(
    model: Path,
    prompts: list[list[int]],
    output_len: int,
    concurrencies: list[int],
    extra_args: list[str],
) -> list[Measurement]:
    stack = LocalStack(extra_args, model=model)
    try:
        stack.wait_ready(timeout=600.0)
        results = []
        for concurrency in concurrencies:
            before = load_average()
            run = asyncio.run(http_run(stack.http_url, prompts, output_len, concurrency))
            results.append(
                Measurement(
                    f"(a) full stack over HTTP, concurrency {concurrency}",
                    run.output_tokens,
                    run.seconds,
                    before,
                    load_average(),
                    run.detail,
                )
            )
            print(results[-1].line(), flush=True)
        return results
    finally:
        stack.stop()


# ---- (b) the engine in process -------------------------------------------------------


def measure_inprocess(
    model: Path,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    threads: int,
    dtype: str,
) -> Measurement:
    """The engine as the stack's worker and scheduler would run it: the same
    ``--dtype`` resolution (``auto``: by the CPU) and the step token budget the
    worker asks the scheduler for on this hardware."""
    from kvmesh.worker.config import CacheConfig, ModelConfig
    from kvmesh.worker.model_runner import ModelRunner
    from kvmesh.worker.step_budget import preferred_step_tokens

    model_config = ModelConfig.from_pretrained(model, dtype=dtype, max_model_len=2048)
    runner = ModelRunner(
        model_config, CacheConfig(block_size=16, num_kv_blocks=2048), num_threads=threads
    )
    budget = preferred_step_tokens("cpu", model_config.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    InProcessEngine(runner, max_num_batched_tokens=budget).generate(prompts[:2], params, 2)
    engine = InProcessEngine(runner, max_num_batched_tokens=budget)
    before = load_average()
    started = time.perf_counter()
    results = engine.generate(prompts, params, concurrency)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_token_ids) for r in results)
    assert tokens == len(prompts) * output_len, tokens
    return Measurement(
        f"(b) engine in process, concurrency {concurrency}",
        tokens,
        seconds,
        before,
        load_average(),
        f"{str(model_config.dtype).removeprefix('torch.')}, {budget}-token steps",
    )


# ---- (c) transformers ----------------------------------------------------------------


def measure_hf(
    model: Path, prompts: list[list[int]], output_len: int, batch_size: int
) -> Measurement:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def generate(batch: list[list[int]]) -> int:
        input_ids = torch.tensor(batch)
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=hf_model.config.eos_token_id,
            )
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    generate(prompts[:2])  # warm-up
    before = load_average()
    started = time.perf_counter()
    tokens = sum(generate(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
    seconds = time.perf_counter() - started
    return Measurement(
        f"(c) transformers float32, static batches of {batch_size}",
        tokens,
        seconds,
        before,
        load_average(),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--concurrency-large", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype of (a) and (b), as `kvmesh up --dtype` (auto: by the CPU)",
    )
    parser.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        help="extra `kvmesh up` flag, repeatable (e.g. --stack-arg=--no-async-scheduling)",
    )
    parser.add_argument("--skip", action="append", default=[], choices=["a", "b", "c"])
    args = parser.parse_args()
    model = args.model or default_model_path()
    from kvmesh.worker.config import ModelConfig

    vocab_size = ModelConfig.from_pretrained(model, dtype="float32").vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    print(
        f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, "
        f"ignore_eos; {os.cpu_count()} CPUs; load {load_average()}",
        flush=True,
    )
    torch.set_num_threads(args.threads)
    results: dict[str, Measurement] = {}
    if "a" not in args.skip:
        concurrencies = [args.concurrency]
        if args.concurrency_large:
            concurrencies.append(args.concurrency_large)
        stack_args = [f"--dtype={args.dtype}", *args.stack_arg]
        for m in measure_stack(model, prompts, args.output_len, concurrencies, stack_args):
            results.setdefault("a", m)
            results[f"a{m.label.rsplit(' ', 1)[-1]}"] = m
    if "b" not in args.skip:
        results["b"] = measure_inprocess(
            model, prompts, args.output_len, args.concurrency, args.threads, args.dtype
        )
        print(results["b"].line(), flush=True)
    if "c" not in args.skip:
        results["c"] = measure_hf(model, prompts, args.output_len, args.hf_batch_size)
        print(results["c"].line(), flush=True)
    print()
    for label in sorted(results):
        if label in ("a", "b", "c"):
            print(results[label].line())
    if "a" in results and "c" in results:
        print(f"a/c = {results['a'].tokens_per_s / results['c'].tokens_per_s:.2f}  (target >= 2.5)")
    if "a" in results and "b" in results:
        print(
            f"a/b = {results['a'].tokens_per_s / results['b'].tokens_per_s:.2f}  (target >= 0.85)"
        )
    large = results.get(f"a{args.concurrency_large}")
    if large is not None:
        print(
            f"(a) at concurrency {args.concurrency_large}: {large.tokens_per_s:.1f} tok/s "
            f"(target >= 240, half the ~480 tok/s decode ceiling)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
