"""Triton kernel that scatters new K/V rows into the paged cache by slot mapping.

Imports triton at module import: load this module only through
``kvmesh.kernels.triton_backend``, which does so lazily. Whether kernels run on a GPU
or in Triton's CPU interpreter is fixed when this module is first imported
(``TRITON_INTERPRET`` is read by ``triton.jit``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per new token: copy its [num_kv_heads, head_dim] K and V rows.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    # A negative slot (padding, or a token whose KV is not kept) writes nothing.
    # The slot is broadcast to a full tile first: the interpreter mis-types
    # (as int32) a mask built from a scalar comparison.
    slot_tile = tl.zeros([HEADS_PAD, DIM_PAD], dtype=tl.int64) + slot
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slot_tile >= 0)
    cache_offsets = slot_tile * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
    )
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the Triton cache writer needs contiguous K/V caches")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
