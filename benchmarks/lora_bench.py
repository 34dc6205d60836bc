"""Multi-LoRA throughput: requests spread over 1, 4 and 8 adapters vs the base model alone.

Usage: .venv/bin/python -m benchmarks.lora_bench [--model PATH] [--num-requests N]
       [--threads T] [--dtype auto|float32|bfloat16] [--lora-kernel auto|torch|both]

The real Scheduler drives a ModelRunner in one process (kvmesh/engine.py),
with ``--max-loras 8 --max-lora-rank 16``. Each run submits the same prompts at once
(random tokens, greedy, ``ignore_eos``); requests take adapters round-robin, so
every step mixes all of a run's adapters. Adapters are rank 16 on all seven
projections (q, k, v, o, gate, up, down), with random nonzero A and B, written
in PEFT's layout; each is loaded into its slot by an untimed warm-up request, so
the runs measure serving, not loading. Runs alternate (base, then each adapter
count per LoRA kernel) for ``--rounds`` rounds and each configuration keeps its
best round: this box is shared and noisy. Prints output tokens per second and
per CPU second (steadier on a shared box with ``--threads 1``), each with its
ratio to the base model.

``--lora-kernel``: ``auto`` is what the worker chose at load (the C++ kernel on
CPU where it builds), ``torch`` the per-adapter torch matmuls, ``both`` runs
each adapter count with both in the same rounds (before/after in one run).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvmesh.engine import InProcessEngine
from kvmesh.services.contracts.lora_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_id
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner

RANK = 16
ADAPTER_COUNTS = (1, 4, 8)


def write_adapter(folder: Path, runner: ModelRunner, seed: int) -> LoRARequest:
    """A rank-16 PEFT adapter on every projection of every layer of ``runner``'s model."""
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": list(runner.model.declaration.lora_targets),
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    targets = runner.model.declaration.lora_targets
    for layer, projections in enumerate(runner.model.lora_shapes()):
        for shape in projections.values():
            for module, _, size in shape.slices:
                prefix = f"base_model.model.model.layers.{layer}.{targets[module].path}"
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(RANK, shape.in_features, generator=generator) * 0.01
                )
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(size, RANK, generator=generator) * 0.01
                )
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    return LoRARequest(f"bench-{seed}", adapter_id(folder), str(folder))


def run_once(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    adapters: list[LoRARequest | None],
    tag: str,
) -> tuple[float, float]:
    """Output tokens per second of all prompts submitted at once: per wall-clock
    second and per CPU second of this process (all its threads)."""
    engine = InProcessEngine(runner, max_num_seqs=len(prompts), max_num_batched_tokens=2048)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params, adapters[index % len(adapters)])
    started, started_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    tokens = sum(len(r.output_token_ids) for r in engine.results.values())
    return tokens / elapsed, tokens / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--dtype", default="auto", help="auto (as served), float32 or bfloat16")
    parser.add_argument("--lora-kernel", choices=["auto", "torch", "both"], default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    runner = ModelRunner(
        ModelConfig.from_pretrained(args.model, dtype=args.dtype, max_model_len=512),
        CacheConfig(block_size=16, num_kv_blocks=1024),
        num_threads=args.threads,
        max_loras=max(ADAPTER_COUNTS),
        max_lora_rank=RANK,
    )
    slots = runner.lora_slots
    assert slots is not None
    chosen = "native" if slots.native else "torch"
    kernels = {"auto": [chosen], "torch": ["torch"], "both": sorted({chosen, "torch"})}
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, runner.vocab_size, (args.num_requests, args.prompt_len), generator=generator
    ).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [write_adapter(Path(tmp) / f"a{i}", runner, i) for i in range(max(ADAPTER_COUNTS))]
        warm = SamplingParams(temperature=0.0, max_tokens=2)
        run_once(runner, [prompts[0]] * len(loras), warm, list(loras), "warm")  # fill the slots
        # name -> (adapters, LoRA kernel or None for the base model)
        runs: dict[str, tuple[list[LoRARequest | None], str | None]] = {"base": ([None], None)}
        for kernel in kernels[args.lora_kernel]:
            runs.update({f"{n} adapters {kernel}": (loras[:n], kernel) for n in ADAPTER_COUNTS})
        best = dict.fromkeys(runs, 0.0)
        best_cpu = dict.fromkeys(runs, 0.0)
        for round_index in range(args.rounds):
            for name, (adapters, kernel) in runs.items():
                if kernel is not None:
                    slots.set_native(kernel == "native")
                rate, cpu_rate = run_once(
                    runner, prompts, params, adapters, f"{name}-{round_index}"
                )
                best[name] = max(best[name], rate)
                best_cpu[name] = max(best_cpu[name], cpu_rate)
                print(
                    f"round {round_index + 1}: {name} {rate:.1f} tok/s, {cpu_rate:.1f} tok/cpu-s",
                    flush=True,
                )
    print(
        f"{args.num_requests} requests at once, {args.prompt_len} prompt + {args.output_len} "
        f"output tokens, rank {RANK} on q/k/v/o/gate/up/down, {runner.model_config.dtype}, "
        f"{torch.get_num_threads()} threads, best of {args.rounds} rounds; "
        f"LoRA kernel chosen at load: {chosen}"
    )
    # Per CPU second: what a neighbour's load does not take away (with one
    # thread, preemption stops the clock); wall-clock is what a user sees.
    print(f"{'run':<20} {'tok/s':>8} {'vs base':>8} {'tok/cpu-s':>10} {'vs base':>8}")
    for name, rate in best.items():
        cpu_rate = best_cpu[name]
        print(
            f"{name:<20} {rate:8.1f} {rate / best['base']:8.2f} "
            f"{cpu_rate:10.1f} {cpu_rate / best_cpu['base']:8.2f}"
        )


if __name__ == "__main__":
    main()
