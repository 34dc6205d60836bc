"""Where a decode step of a batch goes, in process (issue 39, concurrency 16).

Loads a GGUF folder (default: llama.cpp's own Q4_K_M file of the default model,
the one ``benchmarks/llamacpp_compare.py`` serves), starts ``--rows`` requests,
runs their prefill, then times decode steps of that many rows on the wall clock
and the process CPU clock, the row counts taking turns round by round. One
further run of steps under ``torch.profiler`` splits a step into: projections by
ggml type (each GGUF projection call wrapped in a labelled range), the LM head,
attention, norms / rope / activation, sampling, and the rest (Python and
bookkeeping: the step's wall time not inside any of those).

``--ab`` times each row count twice per round instead, the projections
dispatched as now and as before the float32 GEMM over dequantized panels
(``FLOAT_GEMM_MIN_ROWS*`` set out of reach: int8 kernels up to
``MAX_GGML_Q8_KERNEL_ROWS``, float tiles + oneDNN above), and one prefill step
of ``--prefill`` tokens (one prompt) both ways.

    python -m benchmarks.decode_batch_profile [--folder F] [--rows 8 16]
        [--threads 2] [--steps 16] [--rounds 3] [--quantization w8a8] [--ab]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import ggml_linear
from kvmesh.worker.models.ggml_linear import GGMLLinear

DEFAULT_FOLDER = Path.home() / ".cache/kvmesh/llamacpp/gguf/SmolLM2-135M-Instruct-Q4_K_M"
PROMPT_TOKENS = 128
# Profiler op names (substrings) per part of the step, first match wins.
PARTS = (
    ("attention", ("attention", "kv_cache_write", "sdpa", "softmax")),
    ("norms/rope/act", ("rms_norm", "rotary", "silu", "add_rms")),
    ("sampling", ("argmax", "sample", "penalt", "topk", "top_p", "greedy")),
)


def _runner(folder: Path, threads: int, quantization: str | None, rows: int) -> ModelRunner:
    blocks = max(rows * (PROMPT_TOKENS + 512), 2048) // 16 + 8
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=2048, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=blocks),
        num_threads=threads,
    )


def _driver(runner: ModelRunner, rows: int, tokens: int) -> LocalDriver:
    """``rows`` requests, prefilled: every later step is a decode step of ``rows`` rows."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for r in range(rows):
        prompt = [(31 * i + 7 * r) % 1000 + 10 for i in range(PROMPT_TOKENS)]
        driver.add_request(f"r{r}", prompt, params, tokens)
    driver.step()  # every prompt in one prefill step (and its first token)
    return driver


def _time_steps(runner: ModelRunner, rows: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per decode step of ``rows`` rows, mean over ``steps``."""
    driver = _driver(runner, rows, steps + 4)
    driver.step()  # warm
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        driver.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


@contextmanager
def _labelled_projections() -> Iterator[None]:
    """Each GGUF projection call inside a profiler range naming its types (LM head apart)."""
    original = GGMLLinear.__call__

    def call(self: GGMLLinear, x: torch.Tensor) -> torch.Tensor:
        kinds = "+".join(sorted({k.name for k in self.rows.kinds}))
        label = "lm_head" if self.out_features > 10_000 else kinds
        with record_function(f"proj:{label}"):
            return original(self, x)

    GGMLLinear.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        GGMLLinear.__call__ = original  # type: ignore[method-assign]


def _split(runner: ModelRunner, rows: int, steps: int) -> dict[str, float]:
    """ms per step by part (self CPU time of the profiled ops), and the step's wall."""
    driver = _driver(runner, rows, steps + 4)
    driver.step()
    with _labelled_projections(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            driver.step()
        wall = time.perf_counter() - start
    parts: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        if name.startswith("proj:"):
            # A range's CPU total includes its ops: the whole projection call.
            parts[name] += event.cpu_time_total / 1e3
            continue
        for part, needles in PARTS:
            if any(n in name.lower() for n in needles):
                parts[part] += event.self_cpu_time_total / 1e3
                break
    result = {k: v / steps for k, v in parts.items()}
    result["step (wall)"] = wall * 1e3 / steps
    # Profiled time is per thread, the wall is the caller's: with intra-op threads
    # the ranges are still one caller thread's spans.
    result["rest (Python, bookkeeping)"] = result["step (wall)"] - sum(
        v for k, v in result.items() if k != "step (wall)"
    )
    return result


@contextmanager
def _dispatch(name: str) -> Iterator[None]:
    """ "after": the dispatch as it is; "before": no float GEMM over dequantized panels."""
    saved = ggml_linear.FLOAT_GEMM_MIN_ROWS, ggml_linear.FLOAT_GEMM_MIN_ROWS_W8A8
    if name == "before":
        ggml_linear.FLOAT_GEMM_MIN_ROWS = ggml_linear.FLOAT_GEMM_MIN_ROWS_W8A8 = 1 << 30
    try:
        yield
    finally:
        ggml_linear.FLOAT_GEMM_MIN_ROWS, ggml_linear.FLOAT_GEMM_MIN_ROWS_W8A8 = saved


def _prefill_seconds(runner: ModelRunner, tokens: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one prefill step of a ``tokens``-token prompt."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    driver.add_request("p", [(13 * i) % 1000 + 10 for i in range(tokens)], params, 1)
    wall, cpu = time.perf_counter(), time.process_time()
    driver.run()
    return time.perf_counter() - wall, time.process_time() - cpu


def ab(args: argparse.Namespace, runners: dict[int, ModelRunner]) -> None:
    """Decode steps and a prefill step, before / after, alternating (best of rounds)."""
    cases = [*(("decode", r) for r in args.rows), ("prefill", args.prefill)]
    best = {(c, n, w): [float("inf")] * 2 for c, n in cases for w in ("before", "after")}
    prefill_runner = runners[args.rows[0]]
    for index in range(args.rounds):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")
        for case, n in cases:
            for way in order:
                with _dispatch(way):
                    if case == "decode":
                        wall, cpu = _time_steps(runners[n], n, args.steps)
                    else:
                        wall, cpu = _prefill_seconds(prefill_runner, n)
                key = (case, n, way)
                best[key] = [min(best[key][0], wall), min(best[key][1], cpu)]
    for case, n in cases:
        (bw, bc), (aw, ac) = best[(case, n, "before")], best[(case, n, "after")]
        label = f"{n} rows decode step" if case == "decode" else f"{n}-token prefill"
        print(
            f"{label}: before {bw * 1e3:.2f} ms wall ({bc * 1e3:.2f} CPU), "
            f"after {aw * 1e3:.2f} ms wall ({ac * 1e3:.2f} CPU): {bw / aw:.2f}x wall, "
            f"{bc / ac:.2f}x CPU",
            flush=True,
        )


def timed_split(args: argparse.Namespace, runners: dict[int, ModelRunner]) -> None:
    """Per row count: the step's wall and CPU time (best of rounds), then its split."""
    best: dict[int, list[float]] = {r: [float("inf"), float("inf")] for r in args.rows}
    for index in range(args.rounds):
        order = args.rows if index % 2 == 0 else list(reversed(args.rows))
        for rows in order:
            wall, cpu = _time_steps(runners[rows], rows, args.steps)
            best[rows] = [min(best[rows][0], wall), min(best[rows][1], cpu)]
    for rows in args.rows:
        wall, cpu = best[rows]
        print(
            f"{rows} rows: decode step {wall * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms CPU "
            f"(best of {args.rounds} rounds of {args.steps} steps)"
        )
        split = _split(runners[rows], rows, args.steps)
        for part, ms in sorted(split.items(), key=lambda kv: -kv[1]):
            print(f"  {part:28s} {ms:8.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", choices=["w8a8", "none"], default="w8a8")
    parser.add_argument("--ab", action="store_true")
    # Without --ab: the dispatch to time and split ("before": no float GEMM).
    parser.add_argument("--dispatch", choices=["before", "after"], default="after")
    parser.add_argument("--prefill", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quantization = None if args.quantization == "none" else args.quantization
    runners = {r: _runner(args.folder, args.threads, quantization, r) for r in args.rows}
    print(f"load average {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        if args.ab:
            ab(args, runners)
        else:
            with _dispatch(args.dispatch):
                timed_split(args, runners)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
