"""Decode throughput of one worker vs a tensor-parallel replica of the same model,
and of a pipeline-parallel replica with and without stage overlap.

Each run spawns the replica's ranks (gloo on CPU, NCCL on CUDA, one GPU per
rank), drives them in process exactly as the worker service does (the driver
broadcasts each step; worker/parallel/driver.py), and times the decode steps of
``--batch`` requests after their prefill. TP=1 runs in the same script first,
so the ratio compares runs on the same machine minutes apart.

``--pp P`` (P > 1) instead runs the real scheduler in process
(kvmesh/engine.py) over a TP x PP replica twice: without overlap
(one step at a time, the whole batch each) and with it (P micro-batches, one
begun per stage), and prints the ratio.

Run from the repository root:
    PYTHONPATH=. python benchmarks/tp_decode_bench.py --tp 1 2 [--device cuda]
    PYTHONPATH=. python benchmarks/tp_decode_bench.py --tp 1 --pp 2
"""

from __future__ import annotations

import argparse
import time

import torch

from kvmesh.engine import InProcessEngine
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.driver import lead_or_follow
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.local_replica import run_local_replica
from kvmesh.worker.parallel.rank_service import rank_device


def _decode_tokens_per_s(runner, batch: int, prompt_len: int, new_tokens: int) -> float:
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(17 * i + j) % 30_000 + 100 for j in range(prompt_len)]
        driver.add_request(f"r{i}", prompt, params, max_new_tokens=new_tokens)
    driver.step()  # every prefill, and the first tokens
    start = time.perf_counter()
    steps = 0
    while driver.requests:
        driver.step()
        steps += 1
    return steps * batch / (time.perf_counter() - start)


def _prompts(batch: int, prompt_len: int) -> list[list[int]]:
    return [[(17 * i + j) % 30_000 + 100 for j in range(prompt_len)] for i in range(batch)]


def _engine_decode_tokens_per_s(
    runner, batch: int, prompt_len: int, new_tokens: int, micro_batches: int
) -> float:
    """The real scheduler over ``runner``: decode tokens per second once every
    request has its first token (``micro_batches`` > 1: pipeline overlap)."""
    engine = InProcessEngine(
        runner, max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
        num_micro_batches=micro_batches,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    for i, prompt in enumerate(_prompts(batch, prompt_len)):
        engine.add_request(f"r{i}", prompt, params)
    results = engine.results.values()
    while not all(r.output_token_ids for r in results):  # every prefill
        engine.step()
    first = sum(len(r.output_token_ids) for r in results)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    return (sum(len(r.output_token_ids) for r in results) - first) / elapsed


def _rank_main(layout: RankLayout, address: str, args: argparse.Namespace, out) -> None:
    device = rank_device(args.device, layout.rank)
    collectives = Collectives(layout, address, 300, device) if layout.is_parallel else None
    runner = ModelRunner(
        ModelConfig.from_pretrained(default_model_path(), max_model_len=1024),
        CacheConfig(block_size=16, num_kv_blocks=args.batch * 64),
        device=str(device),
        num_threads=args.threads_per_rank or None,
        collectives=collectives,
    )
    if collectives is None:
        out.put(_decode_tokens_per_s(runner, args.batch, args.prompt_len, args.new_tokens))
        return
    if args.micro_batches:
        rate = lead_or_follow(
            runner,
            collectives,
            lambda lead: _engine_decode_tokens_per_s(
                lead, args.batch, args.prompt_len, args.new_tokens, args.micro_batches
            ),
        )
    else:
        rate = lead_or_follow(
            runner,
            collectives,
            lambda lead: _decode_tokens_per_s(lead, args.batch, args.prompt_len, args.new_tokens),
        )
    if layout.is_driver:
        out.put(rate)
    collectives.close()


def measure(tp_size: int, args: argparse.Namespace, pp_size: int = 1) -> float:
    return run_local_replica(_rank_main, tp_size, pp_size, (args,), timeout_s=1800)


def compare_overlap(tp_size: int, pp_size: int, args: argparse.Namespace) -> None:
    """PP without overlap, then with it, on the same replica shape."""
    rates = {}
    for overlap in (False, True):
        args.micro_batches = pp_size if overlap else 1
        rates[overlap] = measure(tp_size, args, pp_size)
        print(
            f"TP={tp_size} PP={pp_size} overlap={'on' if overlap else 'off'} "
            f"device={args.device} batch={args.batch}: {rates[overlap]:8.1f} decode tokens/s",
            flush=True,
        )
    print(f"overlap on / off: {rates[True] / rates[False]:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--pp", type=int, default=1, help="> 1: pipeline overlap on vs off at TP=--tp[0]"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads-per-rank", type=int, default=0, help="torch threads per rank (0: all cores)"
    )
    args = parser.parse_args()
    args.micro_batches = 0  # the LocalDriver path
    if args.pp > 1:
        compare_overlap(args.tp[0], args.pp, args)
        return
    if args.device.startswith("cuda") and max(args.tp) > torch.cuda.device_count():
        parser.error(f"TP={max(args.tp)} needs as many GPUs; {torch.cuda.device_count()} visible")
    baseline = None
    for tp_size in args.tp:
        rate = measure(tp_size, args)
        baseline = baseline or rate
        print(
            f"TP={tp_size} device={args.device} batch={args.batch}: "
            f"{rate:8.1f} decode tokens/s  ({rate / baseline:.2f}x TP={args.tp[0]})",
            flush=True,
        )


if __name__ == "__main__":
    main()
