"""Single-stream decode against the machine's memory bandwidth.

A batch-1 decode step reads every weight once, so its speed is bounded by
memory bandwidth / weight bytes. This prints, in one run:

* a bandwidth probe: a ``memcpy``-style copy of a buffer far larger than the
  caches (bytes read + written per second) and a read-only sum over one;
* for each model given (a checkpoint folder or a GGUF folder, e.g. the files of
  tests/worker/kquant_files.py): the weight bytes one decode step reads (its
  projections' resident bytes: codes, blocks or dense), the mean time of a
  batch-1 decode step (engine steps through LocalDriver, prefill excluded),
  and the weight GB/s that makes, as a fraction of the probe's read GB/s;
* the same projections run alone (one batch-1 pass over all of them), and
  the rest of the step: attention, norms, sampling and the step's Python;
* with ``--quantization w8a8``, each model a second time on int8
  activations (a GGUF file's blocks: kernels/csrc/ggml_q8_linear.cpp);
* with ``--layers-ab``, the decode step with each layer in one C++ call
  (``DecoderLayer.forward_row``: GGUF blocks on int8 activations, batch 1)
  against the same layers' Python forward, in alternating rounds (best of
  each); ``--cpu-clock`` times on the process CPU clock instead of the wall
  (a loaded box; with one thread, a step's CPU time is its work);
* with ``--crossover``, the kernel over the blocks vs tile rebuild + GEMM per
  row count for every projection of the first model (the choice of
  ``MAX_GGML_KERNEL_ROWS``).

    python -m benchmarks.decode_bandwidth [--model FOLDER ...] [--mix Q4_K_M ...]
        [--threads 2] [--tokens 64] [--crossover] [--quantization w8a8]
        [--layers-ab] [--cpu-clock]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.cpu_features import CpuFeatures
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import ggml_linear
from kvmesh.worker.models.ggml_linear import GGMLLinear
from tests.worker.kquant_files import MIXES, write_mix

PROBE_BYTES = 512 * 2**20


def bandwidth_probe(rounds: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s): best of ``rounds``."""
    src = torch.ones(PROBE_BYTES // 4)
    dst = torch.empty_like(src)
    copy = read = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - start)
    return 2 * PROBE_BYTES / copy / 1e9, PROBE_BYTES / read / 1e9


def _runner(folder: Path, threads: int, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=512, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=64),
        num_threads=threads,
    )


# The clock of the step timings: the wall, or (--cpu-clock) the process's CPU time.
_clock = time.perf_counter
PROMPT = [(17 * i) % 1000 + 10 for i in range(16)]


def _generate(runner: ModelRunner, prompt: list[int], tokens: int) -> float:
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    driver.add_request("bench", prompt, params, tokens)
    start = _clock()
    driver.run()
    return _clock() - start


def _one_round(runner: ModelRunner, tokens: int) -> float:
    prefill = _generate(runner, PROMPT, 1)
    return (_generate(runner, PROMPT, tokens + 1) - prefill) / tokens


def decode_step_seconds(runner: ModelRunner, tokens: int, rounds: int = 3) -> float:
    """Mean seconds of one batch-1 decode step (best of ``rounds``), prefill excluded."""
    _generate(runner, PROMPT, 4)  # warm up
    return min(_one_round(runner, tokens) for _ in range(rounds))


def layers_ab(runner: ModelRunner, tokens: int, rounds: int = 4) -> tuple[float, float] | None:
    """(fused, Python) mean decode step seconds, best of ``rounds`` alternating
    rounds each; None when no layer of the model runs fused."""
    layers = list(runner.model.layers)
    fused = [layer.row_args for layer in layers]
    if all(args is None for args in fused):
        return None
    best = {"fused": float("inf"), "python": float("inf")}
    try:
        for index in range(rounds):
            order = ("fused", "python") if index % 2 == 0 else ("python", "fused")
            for name in order:
                for layer, args in zip(layers, fused, strict=True):
                    layer.row_args = args if name == "fused" else None
                best[name] = min(best[name], _one_round(runner, tokens))
    finally:
        for layer, args in zip(layers, fused, strict=True):
            layer.row_args = args
    return best["fused"], best["python"]


def projection_seconds(runner: ModelRunner, rounds: int = 5) -> float:
    """Seconds of one batch-1 pass over every projection alone (best of ``rounds``):
    what a step spends in weight kernels; the rest of the step is attention,
    norms, sampling and the Python between them."""
    projections = runner.model._all_packed()
    inputs = [torch.randn(1, p.in_features) for p in projections]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            start = _clock()
            for p, x in zip(projections, inputs, strict=True):
                p(x)
            best = min(best, _clock() - start)
    return best


def crossover(runner: ModelRunner, rows_list: list[int], rounds: int = 5) -> None:
    """Kernel vs tiles per row count, over every GGUF-block projection of the model."""
    projections = [p for p in runner.model._all_packed() if isinstance(p, GGMLLinear)]
    if not projections:
        print("crossover: no GGUF-block projections in this model")
        return
    print(f"crossover over {len(projections)} projections (ms per pass, best of {rounds})")
    saved = ggml_linear.MAX_GGML_KERNEL_ROWS
    try:
        for rows in rows_list:
            times = {}
            for name, limit in (("kernel", 1 << 30), ("tiles", 0)):
                ggml_linear.MAX_GGML_KERNEL_ROWS = limit
                inputs = [torch.randn(rows, p.in_features) for p in projections]
                best = float("inf")
                for _ in range(rounds):
                    start = time.perf_counter()
                    for p, x in zip(projections, inputs, strict=True):
                        p(x)
                    best = min(best, time.perf_counter() - start)
                times[name] = best * 1e3
            print(
                f"  {rows:4d} rows: kernel {times['kernel']:7.1f}  tiles {times['tiles']:7.1f}"
                f"  ({times['tiles'] / times['kernel']:.2f}x)"
            )
    finally:
        ggml_linear.MAX_GGML_KERNEL_ROWS = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", default=[])
    parser.add_argument("--mix", action="append", choices=MIXES, default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--crossover", action="store_true")
    # "w8a8": a GGUF file's blocks on int8 activations (kernels/csrc/ggml_q8_linear.cpp);
    # given, each model runs both ways.
    parser.add_argument("--quantization", choices=["w8a8"], default=None)
    parser.add_argument("--layers-ab", action="store_true")
    parser.add_argument("--cpu-clock", action="store_true")
    args = parser.parse_args(argv)
    global _clock
    _clock = time.process_time if args.cpu_clock else time.perf_counter
    torch.set_num_threads(args.threads)
    models = [*args.model, *(write_mix(default_model_path(), m).folder for m in args.mix)]
    models = models or [default_model_path()]
    cpu = CpuFeatures.detect()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {args.threads} threads")
    copy_gbs, read_gbs = bandwidth_probe()
    print(f"bandwidth probe: copy {copy_gbs:.1f} GB/s (read + write), read {read_gbs:.1f} GB/s")
    for index, folder in enumerate(models):
        for quantization in (None, args.quantization) if args.quantization else (None,):
            runner = _runner(folder, args.threads, quantization)
            weight_bytes = runner.model.weight_bytes()["projections"]
            step = decode_step_seconds(runner, args.tokens)
            gbs = weight_bytes / step / 1e9
            # A kquant_files folder is "named": its parent names the mix.
            label = folder.parent.name if folder.name == "named" else folder.name
            label += f" ({quantization})" if quantization else ""
            print(
                f"{label}: {weight_bytes / 1e6:.1f} MB of projection weights per step, "
                f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s), "
                f"{gbs:.1f} GB/s = {gbs / read_gbs:.0%} of the read probe",
                flush=True,
            )
            kernels = projection_seconds(runner)
            print(
                f"  projections alone {kernels * 1e3:.2f} ms ({weight_bytes / kernels / 1e9:.1f} "
                f"GB/s); the rest of the step (attention, norms, sampling, Python) "
                f"{(step - kernels) * 1e3:.2f} ms",
                flush=True,
            )
            ab = layers_ab(runner, args.tokens) if args.layers_ab else None
            if ab is not None:
                fused, python = ab
                print(
                    f"  layers in one C++ call each {fused * 1e3:.2f} ms, their Python forward "
                    f"{python * 1e3:.2f} ms ({python / fused:.2f}x; alternating rounds)",
                    flush=True,
                )
            if args.crossover and index == 0 and quantization is None:
                crossover(runner, [1, 4, 8, 16, 24, 32, 64, 128])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
