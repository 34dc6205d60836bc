"""What KV-cache groups buy a sliding-window model: blocks held and requests run at once.

Drives the real scheduler (no model: the fake worker of tests/scheduler) with
16 requests of 1,744 prompt + 256 output tokens (2,000 in all) in the same KV
memory: as full attention; with a 256-token window on every layer (Mistral:
one windowed group); and as Gemma 2 (half the layers windowed: two groups,
whose blocks each hold half the layers, so the same memory is twice the
blocks). Prints the peak blocks one request holds (in block-sized units of
its own cache), the peak of requests running at once, the preemptions and the
steps to finish everything. Block counts are exact (no timing), so the load
on the machine does not matter.

Run: .venv/bin/python benchmarks/sliding_window_memory.py [--blocks N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.scheduler.factories import make_request, make_scheduler, run_step  # noqa: E402

BLOCK_SIZE = 16
WINDOW = 256
PROMPT, OUTPUT, NUM_REQUESTS = 1744, 256, 16


def run(windows: tuple[int | None, ...], num_blocks: int) -> tuple[int, int, int, int]:
    """(peak blocks of one request, peak running, preemptions, steps)."""
    sched = make_scheduler(
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=PROMPT + OUTPUT,
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=512,
        watermark=0.0,
        kv_cache_windows=windows,
        enable_prefix_caching=False,
    )
    requests = [make_request(PROMPT, max_tokens=OUTPUT, ignore_eos=True) for _ in range(16)]
    for request in requests:
        sched.add_request(request)
    kv = sched.kv_cache_manager
    peak_request = peak_running = preemptions = steps = 0
    while sched.has_unfinished_requests():
        run_step(sched)
        steps += 1
        preemptions += sched.make_stats().num_preemptions
        peak_running = max(peak_running, sched.num_running)
        for request in sched.running:
            held = sum(
                sum(
                    1
                    for b in kv.get_blocks(request.request_id, g)
                    if b is not kv.block_pool.null_block
                )
                for g in range(len(windows))
            )
            peak_request = max(peak_request, held)
    return peak_request, peak_running, preemptions, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--blocks", type=int, default=1024, help="KV memory, in blocks of every layer"
    )
    args = parser.parse_args()
    print(
        f"{NUM_REQUESTS} requests of {PROMPT}+{OUTPUT} tokens, KV memory of {args.blocks} "
        f"blocks of {BLOCK_SIZE} tokens in every layer, window {WINDOW}, prompt chunks of 512"
    )
    # (name, group windows, blocks in the same memory: a block of a two-group
    # cache holds half the layers)
    for name, windows, num_blocks in (
        ("full attention (1 group)", (None,), args.blocks),
        ("window only (Mistral, 1 group)", (WINDOW,), args.blocks),
        ("full + window (Gemma 2, 2 groups)", (None, WINDOW), 2 * args.blocks),
    ):
        peak_request, peak_running, preemptions, steps = run(windows, num_blocks)
        print(
            f"{name:34s} peak blocks/request {peak_request:4d}  peak running "
            f"{peak_running:3d}  preemptions {preemptions:3d}  steps {steps:5d}"
        )


if __name__ == "__main__":
    main()
