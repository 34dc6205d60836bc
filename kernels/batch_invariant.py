"""Batch-invariant mode: a request's logits do not depend on the batch it runs in.

Off by default (``--batch-invariant`` or ``VLLM_BATCH_INVARIANT=1`` turn it
on; docs/performance.md, "Batch invariance", has its measured cost). Without
it the CPU path changes a row's arithmetic with the batch in these places
(tests/worker/test_worker_batch_invariance.py sees each):

- projections: up to ``MAX_BLOCK_CODE_ROWS`` rows (32 float32; 12-64 bfloat16
  by level) run the block-code kernel, larger batches oneDNN, whose blocking
  and K order differ; bfloat16 rows 8-96 run the feature-pair kernel at the
  avx512_bf16 level. So a decode step of 33 requests, a prompt prefilled
  whole, the same prompt chunked by 16 and the LM head over 1 or 40 sampled
  rows each sum a row's products in another order.
- attention: decodes run ``paged_decode_attention``, which splits a long
  context into runs whose length comes from the batch's total tokens and the
  thread count; prefill chunks run ``paged_prefill_attention`` (64-key
  blocks, 256-key softmax steps) or torch's SDPA: a token computed in a
  prompt (prefill, a recompute after preemption) and the same token computed
  as a decode (or as a chunk of 1) sum differently.

In the mode:

- a projection whose weight is block codes (every projection of the default
  model, and of any GGUF or ``--quantization`` checkpoint) runs the
  block-code kernel at every batch size: each output is one row's products
  summed in input-feature order by one fused multiply-add chain, whatever the
  row tile (1-16 rows) it shares, and outputs are split over threads by
  16-feature panels, never along K (kernels/csrc/block_code_linear.cpp), so
  neither the batch nor the thread count changes a row's sums. W8A8 rows run
  the int8 kernel at every batch size, for the same reasons. A dense weight
  (no codes) runs its usual kernel on fixed tiles of ``ROW_TILE`` rows, the
  last one padded with zeros, so every call has the same shape whatever the
  batch; that is invariant where the kernel's per-row arithmetic depends only
  on its call shape (oneDNN's does for a fixed thread count; it is checked by
  the tests on the tiny checkpoints, not proven for every oneDNN build).
- attention: every query row, of a prompt chunk or a decode, runs
  ``paged_decode_attention`` over its own context (its position + 1 tokens),
  split into runs of ``RUN_TOKENS`` from token 0: one reduction order per row
  whatever the batch, the chunking, a prefix hit or a recompute. A prompt's
  rows then cost a decode's attention each (no query tiling).
- RMSNorm, SwiGLU, rotary and the KV-cache write are the C++ ops, one row at
  a time in a fixed order already; the mode needs them (it refuses to start
  without the C++ kernels).

The mode is a process setting: one worker process serves one model, and each
kernel asks :func:`enabled` per call (tests turn it on and off around runs
of the same runner with :func:`forced`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from kvmesh.kernels import native

# Tokens per attention run: a multiple of every block size up to 256, long
# enough that a run's merge is noise (the kernel's own minimum when it sizes
# runs from the batch).
RUN_TOKENS = 256
# Rows per call of a dense projection's kernel: a decode batch's size, so that
# small batches pad little.
ROW_TILE = 16


class _Mode:
    enabled = False


_mode = _Mode()


def enabled() -> bool:
    """Whether the process runs in batch-invariant mode."""
    return _mode.enabled


def unsupported_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the mode cannot run here, or None."""
    if torch.device(device).type != "cpu":
        return f"batch-invariant mode runs on CPU only, not {torch.device(device).type}"
    reason = native.unavailable_reason()
    if reason is not None:
        return f"batch-invariant mode needs kvmesh's C++ CPU kernels: {reason}"
    return None


def enable(on: bool = True, device: torch.device | str = "cpu") -> None:
    """Turn the mode on (refused with the reason where it cannot run) or off.

    Call before the model runner is built: its attention backend is chosen then.
    """
    if on and (reason := unsupported_reason(device)) is not None:
        raise ValueError(reason)
    _mode.enabled = on


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """The mode set to ``on`` for a block (tests and benchmarks), then restored."""
    previous = _mode.enabled
    enable(on)
    try:
        yield
    finally:
        _mode.enabled = previous


def tiled_rows(x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``kernel(x)`` computed on fixed ``ROW_TILE``-row tiles of ``x`` (2-D),
    the last tile padded with zero rows, so the kernel always sees one shape."""
    rows = x.shape[0]
    if rows == 0:
        return kernel(x)
    full = rows - rows % ROW_TILE
    pieces = [kernel(x[start : start + ROW_TILE]) for start in range(0, full, ROW_TILE)]
    if full < rows:
        tail = x.new_zeros(ROW_TILE, x.shape[1])
        tail[: rows - full] = x[full:]
        pieces.append(kernel(tail)[: rows - full])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
