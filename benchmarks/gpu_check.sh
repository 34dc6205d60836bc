#!/usr/bin/env bash
# One-shot check of the kernels on a CUDA GPU (prepared for a lent H200; takes a few minutes).
#   1. runs tests/kernels on CUDA (the Triton tests compile for the GPU, not the interpreter),
#   2. times Triton paged decode attention at a large batch and reports the KV bytes it reads
#      per second against the device bandwidth measured here with a big tensor copy,
#      with the torch SDPA path ("cpu" backend, run on CUDA) as a same-run baseline.
# Usage: bash benchmarks/gpu_check.sh
# KVMESH_GPU_CHECK_ALLOW_CPU=1 runs the Python part on CPU with tiny shapes (Triton
# interpreter) to check the script itself where there is no GPU; its numbers mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Read through the config registry (services/runtime/config/process.py), like every setting.
ALLOW_CPU=$("$PYTHON" -m kvmesh.services.runtime.config get KVMESH_GPU_CHECK_ALLOW_CPU)

echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
HAS_CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if ! "$PYTHON" -c "import triton" 2>/dev/null; then
  echo "triton missing: pip install triton"
  "$PYTHON" -m pip install --quiet triton
fi
"$PYTHON" -c "import triton; print('triton', triton.__version__)"

if [[ "$HAS_CUDA" != "1" && "$ALLOW_CPU" != "true" ]]; then
  echo "no CUDA device visible to torch; nothing to check (set KVMESH_GPU_CHECK_ALLOW_CPU=1 for a dry run)"
  exit 1
fi

TESTS_RC=0
if [[ "$HAS_CUDA" == "1" ]]; then
  echo "== tests/kernels on CUDA"
  TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels || TESTS_RC=$?
  export TRITON_INTERPRET=0
else
  echo "== dry run on CPU: skipping the test run, Triton in its interpreter"
  export TRITON_INTERPRET=1
fi

echo "== decode attention timing"
"$PYTHON" - <<'PY'
from __future__ import annotations

import torch

from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.triton_backend import TritonAttentionBackend
from kvmesh.services.contracts.math_utils import cdiv

on_gpu = torch.cuda.is_available()
device = torch.device("cuda" if on_gpu else "cpu")
if on_gpu:
    # Llama-3-8B-like attention: 32 query heads over 8 KV heads, head_dim 128.
    batch, context, heads, kv_heads, head_dim, block_size, iters = 256, 2048, 32, 8, 128, 16, 20
else:
    batch, context, heads, kv_heads, head_dim, block_size, iters = 3, 40, 4, 2, 16, 16, 1


def elapsed_ms(fn, iters: int) -> float:
    """Mean milliseconds per call, after a warm-up call (compilation, autotuning)."""
    fn()
    if not on_gpu:
        import time

        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# Device bandwidth: a copy reads and writes every byte once.
copy_bytes = (4 << 30) if on_gpu else (64 << 20)
src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device)
dst = torch.empty_like(src)
copy_ms = elapsed_ms(lambda: dst.copy_(src), 10 if on_gpu else 1)
bandwidth = 2 * copy_bytes / copy_ms / 1e6  # GB/s
del src, dst
print(f"device {torch.cuda.get_device_name() if on_gpu else 'cpu (dry run)'}")
print(f"copy bandwidth: {bandwidth:,.0f} GB/s ({copy_bytes >> 20} MiB copied)")

for dtype in (torch.float32, torch.bfloat16):
    generator = torch.Generator(device=device).manual_seed(0)
    # Ragged contexts: 3/4 .. 1x of ``context``, most ending mid-block.
    context_lens = torch.randint(
        context * 3 // 4, context + 1, (batch,), generator=generator, device=device
    ).to(torch.int32)
    max_blocks = cdiv(context, block_size)
    num_blocks = batch * max_blocks
    # Each sequence owns distinct blocks, in shuffled physical order.
    block_tables = torch.randperm(num_blocks, generator=generator, device=device)
    block_tables = block_tables.view(batch, max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    query = torch.randn(batch, heads, head_dim, generator=generator, device=device).to(dtype)
    slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    results = {}
    outputs = {}
    for backend in (TritonAttentionBackend(), CpuAttentionBackend()):
        metadata = backend.build_metadata(
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=1,
            max_context_len=context,
        )
        outputs[backend.name] = backend.forward(query, k_cache, v_cache, metadata, scale)
        results[backend.name] = elapsed_ms(
            lambda b=backend, m=metadata: b.forward(query, k_cache, v_cache, m, scale), iters
        )
    max_diff = (outputs["triton"].float() - outputs["cpu"].float()).abs().max().item()
    kv_bytes = int(context_lens.sum()) * kv_heads * head_dim * 2 * k_cache.element_size()
    triton_gbs = kv_bytes / results["triton"] / 1e6
    sdpa_gbs = kv_bytes / results["cpu"] / 1e6
    print(
        f"decode {str(dtype).removeprefix('torch.')}: batch {batch}, context <= {context}, "
        f"{heads}/{kv_heads} heads, head_dim {head_dim}, block {block_size}, "
        f"KV read {kv_bytes / 1e9:.2f} GB"
    )
    print(
        f"  triton {results['triton']:.3f} ms = {triton_gbs:,.0f} GB/s "
        f"({triton_gbs / bandwidth:.0%} of copy bandwidth)"
    )
    print(
        f"  torch sdpa path {results['cpu']:.3f} ms = {sdpa_gbs:,.0f} GB/s "
        f"(triton is {results['cpu'] / results['triton']:.1f}x faster); "
        f"max |triton - sdpa| = {max_diff:.2e}"
    )
PY

echo "== summary"
if [[ "$HAS_CUDA" == "1" ]]; then
  if [[ "$TESTS_RC" == "0" ]]; then echo "tests/kernels on CUDA: passed"; else echo "tests/kernels on CUDA: FAILED (rc=$TESTS_RC)"; fi
fi
exit "$TESTS_RC"
