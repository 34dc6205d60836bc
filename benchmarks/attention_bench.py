"""Decode attention: the reference (one Python iteration per sequence) vs the CPU paths.

``cpu`` gathers contexts into a padded tensor for one masked SDPA; ``cpu_native``
reads the paged cache in place in C++ (kernels/csrc/paged_attention_cpu.cpp).
Prints milliseconds per layer call and speed-ups over the reference and over
``cpu``, all measured in this run.
Shapes follow the default model (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64). Usage: ``python benchmarks/attention_bench.py [--context 256]``.

``--prefill N`` times prefill chunks of N tokens instead (``--prefix P``: on a
cached prefix of P tokens; ``--chunks C`` per step): ``cpu`` runs one torch
SDPA per chunk, ``cpu_native`` all chunks in one C++ call
(kernels/csrc/prefill_attention_cpu.cpp; bfloat16: AMX tiles at the amx level,
vdpbf16ps at avx512_bf16; float32: FMAs on AVX-512 or AVX2 from avx2 up). Prints ms per
layer call and GFLOP/s counting the causal FLOPs (4 x heads x head_dim per
visible query-key pair), the two paths interleaved ``--rounds`` times;
``--native-only`` times the C++ op alone (A/B of two builds of it: run each,
alternately, with its own ``KVMESH_KERNEL_CACHE``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The repository root, for tests.kernels (not an installed package) and so
# that a checkout's own packages win over an editable install's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.kernels import native
from kvmesh.kernels.backend import AttentionBackend
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from kvmesh.services.contracts.math_utils import cdiv
from tests.kernels.paged_batch import make_paged_batch


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` calls: on a shared machine the minimum is the least noisy."""
    fn()  # warm-up: allocator, SDPA dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def time_decode(
    backend: AttentionBackend, batch_size: int, context: int, repeats: int, dtype: torch.dtype
) -> float:
    # Ragged contexts around ``context`` so that most end mid-block.
    seqs = [(context - 1 - (i * 7) % 32, 1) for i in range(batch_size)]
    batch = make_paged_batch(
        seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype
    )
    k_cache, v_cache = batch.fresh_caches()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    metadata = batch.metadata(backend)  # once per step, as the worker does
    return best_ms(
        lambda: backend.forward(batch.query, k_cache, v_cache, metadata, batch.scale), repeats
    )


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def time_decode_layers(
    batch_size: int, context: int, layers: int, repeats: int, dtype: torch.dtype
) -> tuple[float, float]:
    """The C++ decode op over ``layers`` separate caches in turn, as a step's
    layers call it: each cache was last read ``layers - 1`` calls ago, so it
    comes from DRAM, not from a cache level a repeated call would hit. Returns
    the median ms per call and the K/V bytes read per second (GB/s)."""
    seqs = [(context - 1 - (i * 7) % 32, 1) for i in range(batch_size)]
    batch = make_paged_batch(
        seqs,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=16,
        dtype=dtype,
        spare_blocks=batch_size * cdiv(context, 16),
    )
    backend = NativeCpuAttentionBackend()
    caches = []
    for _ in range(layers):
        k_cache, v_cache = batch.fresh_caches()
        backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
        caches.append((k_cache, v_cache))
    metadata = batch.metadata(backend)
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            backend.forward(batch.query, k_cache, v_cache, metadata, batch.scale)
        per_call.append((time.perf_counter() - start) / layers)
    ms = statistics.median(per_call) * 1e3
    kv_bytes = sum(context for context, _ in seqs) * 2 * NUM_KV_HEADS * HEAD_DIM
    kv_bytes *= torch.empty((), dtype=dtype).element_size()
    return ms, kv_bytes / ms / 1e6


def time_prefill(
    backend: AttentionBackend,
    chunk: int,
    prefix: int,
    chunks: int,
    repeats: int,
    dtype: torch.dtype,
) -> float:
    batch = make_paged_batch(
        [(prefix, chunk)] * chunks,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=16,
        dtype=dtype,
    )
    k_cache, v_cache = batch.fresh_caches()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    metadata = batch.metadata(backend)
    return best_ms(
        lambda: backend.forward(batch.query, k_cache, v_cache, metadata, batch.scale), repeats
    )


def causal_flops(chunk: int, prefix: int, chunks: int) -> float:
    """Q K^T and P V over the visible (query, key) pairs only."""
    visible_pairs = chunk * prefix + chunk * (chunk + 1) / 2
    return chunks * 4 * NUM_HEADS * HEAD_DIM * visible_pairs


def prefill_main(args: argparse.Namespace, dtype: torch.dtype) -> None:
    flops = causal_flops(args.prefill, args.prefix, args.chunks)
    print(
        f"{args.chunks} chunk(s) of {args.prefill} tokens on a {args.prefix}-token prefix, "
        f"{flops / 1e9:.2f} GFLOP per layer call"
    )
    if args.native_only:
        # The C++ op alone, no SDPA between its calls: for comparing two builds
        # of it (KVMESH_KERNEL_CACHE), run alternately in separate processes.
        print(f"{'round':>5} {'native ms':>10} {'GFLOP/s':>8}")
        for round_index in range(args.rounds):
            ms = time_prefill(
                NativeCpuAttentionBackend(),
                args.prefill,
                args.prefix,
                args.chunks,
                args.repeats,
                dtype,
            )
            print(f"{round_index:>5} {ms:>10.2f} {flops / ms / 1e6:>8.0f}")
        return
    print(
        f"{'round':>5} {'cpu ms':>8} {'GFLOP/s':>8} {'native ms':>10} {'GFLOP/s':>8} "
        f"{'cpu/native':>11}"
    )
    for round_index in range(args.rounds):
        times = [
            time_prefill(backend, args.prefill, args.prefix, args.chunks, args.repeats, dtype)
            for backend in (CpuAttentionBackend(), NativeCpuAttentionBackend())
        ]
        fast, native_ms = times
        print(
            f"{round_index:>5} {fast:>8.2f} {flops / fast / 1e6:>8.0f} {native_ms:>10.2f} "
            f"{flops / native_ms / 1e6:>8.0f} {fast / native_ms:>10.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=0, help="time prefill chunks of N tokens")
    parser.add_argument("--prefix", type=int, default=0, help="cached tokens before each chunk")
    parser.add_argument("--chunks", type=int, default=1, help="prefill chunks per step")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved prefill A/B rounds")
    parser.add_argument("--native-only", action="store_true", help="prefill: time the C++ op alone")
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decode: time the C++ op over this many layers' caches in turn (from DRAM)",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"C++ kernels at the {native.loaded_level().name} level"
    )
    if args.prefill:
        prefill_main(args, dtype)
        return
    if args.layers:
        print(f"{'batch':>5} {'context':>7} {'layers':>6} {'native ms':>10} {'K/V GB/s':>9}")
        for batch_size in args.batch_sizes:
            ms, gb_per_s = time_decode_layers(
                batch_size, args.context, args.layers, args.repeats, dtype
            )
            row = f"{batch_size:>5} {args.context:>7} {args.layers:>6}"
            print(f"{row} {ms:>10.3f} {gb_per_s:>9.1f}")
        return
    print(
        f"{'batch':>5} {'context':>7} {'reference ms':>13} {'cpu ms':>8} {'native ms':>10} "
        f"{'native/ref':>11} {'native/cpu':>11}"
    )
    for batch_size in args.batch_sizes:
        reference = time_decode(
            TorchReferenceBackend(), batch_size, args.context, args.repeats, dtype
        )
        fast = time_decode(CpuAttentionBackend(), batch_size, args.context, args.repeats, dtype)
        native_ms = time_decode(
            NativeCpuAttentionBackend(), batch_size, args.context, args.repeats, dtype
        )
        print(
            f"{batch_size:>5} {args.context:>7} {reference:>13.3f} {fast:>8.3f} {native_ms:>10.3f} "
            f"{reference / native_ms:>10.1f}x {fast / native_ms:>10.1f}x"
        )


if __name__ == "__main__":
    main()
