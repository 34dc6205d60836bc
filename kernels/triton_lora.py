"""Triton kernels for batched LoRA on GPU: per-token slot index, shrink then expand.

Each program serves one token (Punica's BGMV): it reads its token's slot and
does the shrink ``s = A_slot x`` (one block of rank columns per program) or the
expand ``y += B_slot s`` (one block of output columns). Tokens of the base
model (slot -1) do nothing, so one launch serves every adapter in the step.

Imports triton at module import: load this module lazily
(``kvmesh.worker.lora.slots``); ``TRITON_INTERPRET=1`` at first import runs it in
Triton's CPU interpreter, which is how tests check it against
``kvmesh.kernels.lora_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_RANK = 16
_BLOCK_OUT = 64
_BLOCK_IN = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    in_features,
    rank,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_out,
    BLOCK_RANK: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    token = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    # Broadcast the slot to a tile before comparing: the interpreter mis-types
    # a mask built from a scalar comparison.
    slot_ranks = tl.zeros([BLOCK_RANK], dtype=tl.int64) + slot
    rank_mask = (ranks < rank) & (slot_ranks >= 0)
    acc = tl.zeros([BLOCK_RANK], dtype=tl.float32)
    for start in range(0, in_features, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        col_mask = cols < in_features
        x = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0)
        a = tl.load(
            a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + cols[None, :],
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(a.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    tl.store(out_ptr + token * stride_out + ranks, acc, mask=rank_mask)


@triton.jit
def _expand_kernel(
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    out_features,
    rank,
    stride_shrunk,
    stride_b_slot,
    stride_b_out,
    stride_y,
    BLOCK_OUT: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    token = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    slot_outs = tl.zeros([BLOCK_OUT], dtype=tl.int64) + slot
    out_mask = (outs < out_features) & (slot_outs >= 0)
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for start in range(0, rank, BLOCK_RANK):
        ranks = start + tl.arange(0, BLOCK_RANK)
        rank_mask = ranks < rank
        s = tl.load(shrunk_ptr + token * stride_shrunk + ranks, mask=rank_mask, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_b_slot + outs[:, None] * stride_b_out + ranks[None, :],
            mask=out_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    y_ptrs = y_ptr + token * stride_y + outs
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=out_mask)


def add_lora_triton(
    y: torch.Tensor,  # [num_tokens, out], rows contiguous; updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, rank]
    token_slots: torch.Tensor,  # [num_tokens] int, -1 = no adapter
) -> torch.Tensor:
    """Same contract as ``kvmesh.kernels.lora_reference.add_lora_reference``."""
    num_tokens, in_features = x.shape
    out_features, rank = lora_b.shape[1], lora_b.shape[2]
    if num_tokens == 0:
        return y
    x = x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    # float32 accumulators whatever the activation dtype.
    shrunk = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens, triton.cdiv(rank, _BLOCK_RANK))](
        x,
        lora_a,
        token_slots,
        shrunk,
        in_features,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        shrunk.stride(0),
        BLOCK_RANK=_BLOCK_RANK,
        BLOCK_IN=_BLOCK_IN,
    )
    _expand_kernel[(num_tokens, triton.cdiv(out_features, _BLOCK_OUT))](
        shrunk,
        lora_b,
        token_slots,
        y,
        out_features,
        rank,
        shrunk.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        BLOCK_OUT=_BLOCK_OUT,
        BLOCK_RANK=_BLOCK_RANK,
    )
    return y
