"""One chunked-prefill step of long prompts, as the scheduler builds it, op by op.

At 1,024 in / 64 out with 16 requests in flight the scheduler's CPU token
budget (1,024: ``max_num_batched_tokens`` 0 on a CPU) fills each step with
the decodes of the running requests, the tail of one prompt (whose earlier
chunk is in the paged cache already, so its rows attend to that prefix) and
the head of the next. This script builds such a step through the worker's own
path (``LocalDriver`` -> ``ModelRunner.begin_step``/``finish_step``) and
times, per round:

- ``prepare``: the step's inputs and attention plan (Python, once per round);
- ``forward``: the model's layers plus the LM head over the sampled rows
  (repeated ``--repeats`` times on the same inputs: it rewrites the same K/V);
- ``finish``: forward once more, then sampling and the output (the runner's
  own ``finish_step``).

``--profile`` adds one pass of the forward with every dispatched op timed on
the process CPU-time clock, summed per op class (projections, prefill
attention, decode attention, KV write, norms/rotary/activation, LM head, the
rest); with ``--threads 1`` each op's CPU time is its own, whatever else
runs on the machine. The step's times are given on the wall clock and on the
process CPU-time clock (every thread's CPU seconds, less sensitive to other
processes on the machine than the wall clock).

Usage: ``python benchmarks/prefill_step_bench.py [--model PATH] [--rounds 3]
[--profile] [--threads 1] [--kind mixed|whole]``. A/B of two checkouts: run
each from its own tree, alternately (the kernel cache is keyed by the sources,
so each loads its own build).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# The repository root first, so that a checkout's own packages (and its C++
# kernels) win over an editable install's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch.utils._python_dispatch import TorchDispatchMode

from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import SchedulerOutput
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

PROMPT_LEN = 1024
GREEDY = SamplingParams(temperature=0.0)

# Op classes of the profile, by the first pattern an op's name contains.
OP_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prefill attention (C++)", ("paged_prefill_attention",)),
    ("decode attention (C++)", ("paged_decode_attention",)),
    ("KV write", ("write_kv_cache", "index_copy")),
    (
        "projections (oneDNN / GEMM)",
        ("mkldnn", "linear", "addmm", "aten::mm", "matmul", "block_code", "onednn"),
    ),
    ("norms / rotary / activation", ("rms_norm", "rotary", "silu", "gelu", "rsqrt")),
    ("embedding", ("embedding",)),
    ("copies / views / indexing", ("copy", "cat", "index", "contiguous", "slice", "select")),
)


@dataclass(frozen=True)
class StepShape:
    """The step: ``decodes`` one-token rows on a ``PROMPT_LEN``-token context,
    a tail chunk of ``tail`` tokens on a ``prefix``-token cached prefix, and a
    head chunk of ``head`` tokens of a new prompt."""

    decodes: int
    prefix: int
    tail: int
    head: int

    @property
    def tokens(self) -> int:
        return self.decodes + self.tail + self.head


SHAPES = {
    # Steady state at concurrency 16: 16 decodes and two prompt chunks.
    "mixed": StepShape(decodes=16, prefix=520, tail=PROMPT_LEN - 520, head=504),
    # The first step: one whole prompt, nothing cached.
    "whole": StepShape(decodes=0, prefix=0, tail=0, head=PROMPT_LEN),
}


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return (wall - start[0]) * 1e3, (cpu - start[1]) * 1e3


def build_step(runner: ModelRunner, shape: StepShape, round_index: int) -> SchedulerOutput:
    """A fresh step of ``shape`` (new request ids; cached blocks' contents are
    whatever the cache holds: timing does not depend on them)."""
    runner.reset()
    driver = LocalDriver(runner, chunk_size=max(shape.tail, shape.head, 1))
    generator = torch.Generator().manual_seed(round_index)
    block_size = driver.block_size

    def prompt(length: int) -> list[int]:
        return torch.randint(3, runner.vocab_size, (length,), generator=generator).tolist()

    def cached(tokens: int) -> list[int]:
        return [driver.free_blocks.popleft() for _ in range(cdiv(tokens, block_size))]

    for i in range(shape.decodes):
        # A prompt one token longer than its cached part: a one-row "decode".
        driver.add_request(
            f"r{round_index}-decode{i}",
            prompt(PROMPT_LEN + 1),
            GREEDY,
            1,
            prefix_block_ids=cached(PROMPT_LEN + 1),
            num_computed_tokens=PROMPT_LEN,
        )
    if shape.tail:
        driver.add_request(
            f"r{round_index}-tail",
            prompt(shape.prefix + shape.tail),
            GREEDY,
            1,
            prefix_block_ids=cached(shape.prefix),
            num_computed_tokens=shape.prefix,
        )
    driver.add_request(f"r{round_index}-head", prompt(PROMPT_LEN), GREEDY, 1)
    step = driver.build_step()
    # The head request's chunk: what the budget leaves (the driver chunks evenly).
    step.num_scheduled_tokens[f"r{round_index}-head"] = shape.head
    step.total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
    return step


def op_class(name: str) -> str:
    lowered = name.lower()
    for label, patterns in OP_CLASSES:
        if any(p in lowered for p in patterns):
            return label
    return "other (elementwise, Python-side ops)"


def _projection_flops(shapes: list[object]) -> tuple[float, bool]:
    """(FLOPs, whether it is the LM head) of a projection op from its input
    shapes: ``[rows, in]`` activations times a ``[out, in]`` weight, or block
    codes' ``[out / 16, in, 16]`` panels."""
    dims = [s for s in shapes if isinstance(s, list) and s]
    if len(dims) < 2 or len(dims[0]) != 2:
        return 0.0, False
    rows, width = dims[0]
    weight = dims[1]
    out = weight[0] * weight[2] if len(weight) == 3 else weight[0]
    return 2.0 * rows * width * out, out >= 32_000


class _OpClock(TorchDispatchMode):
    """Every op the forward dispatches, timed on the process CPU-time clock
    (with one torch thread: that op's CPU seconds, robust to other processes
    on the machine, unlike a wall-clock profiler), summed per op class."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, tuple[float, float]] = {}

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        started = time.process_time()
        result = func(*args, **(kwargs or {}))
        seconds = time.process_time() - started
        name = str(getattr(func, "overloadpacket", func))
        label = op_class(name)
        flops = 0.0
        if label.startswith("projections"):
            shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            flops, head = _projection_flops(shapes)
            if head:  # the one projection with a vocabulary of output rows
                label = "LM head (sampled rows only)"
        ms, gflop = self.totals.get(label, (0.0, 0.0))
        self.totals[label] = (ms + seconds * 1e3, gflop + flops / 1e9)
        return result


def profile_forward(forward: Callable[[], object]) -> dict[str, tuple[float, float]]:
    """(CPU milliseconds, GFLOP) per op class of one forward. The mode's own
    Python per op is not counted; the forward's CPU time without it, less the
    ops' sum, bounds what the model's Python costs."""
    clock = _OpClock()
    with clock:
        forward()
    return clock.totals


def attention_gflop(runner: ModelRunner, shape: StepShape) -> float:
    """The prefill chunks' causal attention FLOPs of one forward (4 x heads x
    head_dim per visible query-key pair, every layer)."""
    config = runner.model_config
    pairs = shape.tail * shape.prefix + shape.tail * (shape.tail + 1) // 2
    pairs += shape.head * (shape.head + 1) // 2
    return 4 * config.num_heads * config.head_dim * pairs * config.num_layers / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--kind", choices=sorted(SHAPES), default="mixed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="per-op-class profile")
    args = parser.parse_args()

    shape = SHAPES[args.kind]
    model_config = ModelConfig.from_pretrained(
        args.model, max_model_len=2 * PROMPT_LEN, dtype="float32"
    )
    blocks = (shape.decodes + 3) * cdiv(PROMPT_LEN + 1, 16) + 16
    runner = ModelRunner(model_config, CacheConfig(num_kv_blocks=blocks), num_threads=args.threads)
    print(
        f"model {args.model.name}, backend {runner.backend.name}, "
        f"{torch.get_num_threads()} threads, float32; step of {shape.tokens} tokens: "
        f"{shape.decodes} decodes, {shape.tail} on a {shape.prefix}-token prefix, "
        f"{shape.head} new; load average {os.getloadavg()[0]:.2f}"
    )
    prepare, forward, finish = [], [], []
    for round_index in range(args.rounds):
        step = build_step(runner, shape, round_index)
        start = _clock()
        in_flight = runner.begin_step(step)
        prepare.append(_since(start))

        def run_forward(in_flight: object = in_flight) -> object:
            with torch.inference_mode():
                return runner._forward(in_flight)  # the forward alone, repeatable

        run_forward()  # warm-up: allocator, oneDNN primitives
        for _ in range(args.repeats):
            start = _clock()
            run_forward()
            forward.append(_since(start))
        start = _clock()
        runner.finish_step(in_flight)
        finish.append(_since(start))
        print(
            f"round {round_index}: prepare {prepare[-1][0]:.1f} ms, forward "
            f"{min(f[0] for f in forward[-args.repeats :]):.1f} ms wall "
            f"({min(f[1] for f in forward[-args.repeats :]):.1f} ms CPU), "
            f"finish (forward + sampling) {finish[-1][0]:.1f} ms"
        )
        if args.profile and round_index == args.rounds - 1:
            totals = profile_forward(run_forward)
            if attention := totals.get(OP_CLASSES[0][0]):
                totals[OP_CLASSES[0][0]] = (attention[0], attention_gflop(runner, shape))
            whole = sum(ms for ms, _ in totals.values())
            print(f"profile of one forward ({whole:.1f} ms CPU in ops):")
            for label, (ms, gflop) in sorted(totals.items(), key=lambda item: -item[1][0]):
                rate = f"  {gflop / ms * 1e3:6.1f} GFLOP/s" if gflop else ""
                print(f"  {label:40s} {ms:8.1f} ms  {ms / whole:6.1%}{rate}")

    def median(values: list[tuple[float, float]], index: int) -> float:
        return statistics.median(v[index] for v in values)

    print(
        f"median: prepare {median(prepare, 0):.1f} ms, forward {median(forward, 0):.1f} ms wall "
        f"/ {median(forward, 1):.1f} ms CPU, finish {median(finish, 0):.1f} ms; "
        f"load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
