"""Scheduler cost per step, and what prefix caching buys in time to first token.

1. ``schedule()`` + ``update_from_output()`` with 256 and 1,024 running decode
   requests (prefix caching on, so block hashing is included). The fake worker's
   output is built outside the timed region. Prints µs per step and the
   1024/256 ratio (4.0 = linear).
2. A workload whose requests share a long system prompt, with prefix caching on
   and off: tokens computed before each request's first token, and a simulated
   TTFT under a simple cost model (step time = STEP_OVERHEAD_S + PER_TOKEN_S x
   tokens scheduled in the step; arrivals on the same simulated clock).

Run: .venv/bin/python benchmarks/scheduler_bench.py [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

# The factories live with the tests; run from anywhere, import this checkout.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.scheduler.factories import make_output, make_request, make_scheduler  # noqa: E402

STEP_OVERHEAD_S = 0.005
PER_TOKEN_S = 0.0001


def bench_decode(num_requests: int, num_steps: int) -> float:
    """Median µs of schedule() + update_from_output() over decode-only steps."""
    prompt_len, block_size = 32, 16
    max_len = prompt_len + num_steps + 64
    sched = make_scheduler(
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(2048, num_requests * prompt_len),
        max_model_len=max_len,
        num_kv_blocks=num_requests * (max_len // block_size + 1),
        block_size=block_size,
    )
    for _ in range(num_requests):
        sched.add_request(make_request(prompt_len, max_tokens=max_len, ignore_eos=True))
    out = sched.schedule()  # admits everybody: one prefill step, untimed
    sched.update_from_output(out, make_output(out, scheduler=sched))
    assert sched.num_running == num_requests

    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        model_output = make_output(out, scheduler=sched)
        t2 = time.perf_counter()
        sched.update_from_output(out, model_output)
        t3 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == num_requests
        samples.append((t1 - t0) + (t3 - t2))
    return statistics.median(samples) * 1e6


def simulate_shared_prompt(enable_prefix_caching: bool) -> tuple[float, float]:
    """Mean tokens computed before first token, and mean simulated TTFT (s)."""
    system_prompt = list(range(10_000, 11_024))  # 1,024 shared tokens
    num_requests, arrival_gap_s = 64, 0.02
    now = [0.0]
    sched = make_scheduler(
        clock=lambda: now[0],
        max_num_batched_tokens=2048,
        max_model_len=2048,
        num_kv_blocks=4096,
        enable_prefix_caching=enable_prefix_caching,
    )
    pending = [
        make_request(
            1_024 + 64,
            max_tokens=16,
            ignore_eos=True,
            prompt_token_ids=[*system_prompt, *range(20_000 + 64 * i, 20_064 + 64 * i)],
            arrival_time=i * arrival_gap_s,
        )
        for i in range(num_requests)
    ]
    arrival = {r.request_id: r.arrival_time for r in pending}
    computed_before_first: dict[str, int] = {}
    ttft: dict[str, float] = {}
    computed: dict[str, int] = {}
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= now[0]:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished_requests():
            now[0] = pending[0].arrival_time
            continue
        out = sched.schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            computed[req_id] = computed.get(req_id, 0) + n
        now[0] += STEP_OVERHEAD_S + PER_TOKEN_S * out.total_num_scheduled_tokens
        for output in sched.update_from_output(out, make_output(out, scheduler=sched)):
            rid = output.request_id
            if rid not in ttft:
                ttft[rid] = now[0] - arrival[rid]
                computed_before_first[rid] = computed[rid]
    return statistics.mean(computed_before_first.values()), statistics.mean(ttft.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    args = parser.parse_args()

    # With the garbage collector as the service runs it, then paused during the
    # timed steps: the difference is the GC's share, which grows with the heap.
    for label in ("gc on", "gc paused"):
        if label == "gc paused":
            gc.collect()
            gc.disable()
        results = {n: bench_decode(n, args.steps) for n in (256, 1024)}
        gc.enable()
        for n, us in results.items():
            print(f"[{label}] decode step, {n:5d} running: {us:8.1f} µs ({us / n:.2f} µs/request)")
        print(f"[{label}] ratio 1024/256: {results[1024] / results[256]:.2f} (4.00 = linear)")

    on_tokens, on_ttft = simulate_shared_prompt(True)
    off_tokens, off_ttft = simulate_shared_prompt(False)
    print(
        "shared 1,024-token system prompt, 64 requests x (1,024 + 64) tokens, "
        f"cost model {STEP_OVERHEAD_S * 1e3:.0f} ms/step + {PER_TOKEN_S * 1e6:.0f} µs/token:"
    )
    for label, tokens, ttft in (("on ", on_tokens, on_ttft), ("off", off_tokens, off_ttft)):
        print(
            f"  prefix cache {label}: {tokens:7.1f} tokens computed before the first token, "
            f"simulated TTFT {ttft * 1e3:7.1f} ms"
        )
    print(f"  ratio off/on: tokens {off_tokens / on_tokens:.1f}x, TTFT {off_ttft / on_ttft:.1f}x")


if __name__ == "__main__":
    main()
