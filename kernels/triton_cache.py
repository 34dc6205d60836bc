"""Triton kernel that scatters new K/V rows into the paged cache by slot mapping.

Imports triton at module import: load this module only through
``kvmesh.kernels.triton_backend``, which does so lazily. Whether kernels run on a GPU
or in Triton's CPU interpreter is fixed when this module is first imported
(``TRITON_INTERPRET`` is read by ``triton.jit``).

A quantized cache (--kv-cache-dtype int8 / fp8_e4m3, kernels/kv_quant.py) is
written as its codes and one float32 scale per (token, KV head), computed as
``kv_quant.quantize`` does: IEEE divisions (``div_rn``, not the GPU's
approximate ``/``), int8 rounded to nearest-even, e4m3 built bit by bit as
c10's ``fp8e4m3fn_from_fp32_value`` (torch's ``.to()``) builds it, and stored
as bytes: Triton's own float8 conversion rounds otherwise under the
interpreter (126.9 became 64, not 128), so its codes could not be checked.
fp8_e5m2 is refused by the backend (not written here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels import kv_quant

# Adding then subtracting 1.5 * 2^23 rounds a float32 |y| <= 2^22 to an
# integer, ties to even (IEEE addition rounds so), as torch.round does.
_ROUNDER = 12582912.0


@triton.jit
def _e4m3_bits(y):
    """float32 ``y`` (|y| <= 448) as float8_e4m3fn bits, rounded to nearest-even:
    c10's fp8e4m3fn_from_fp32_value, step for step."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits ^ sign
    # Below 2^-6 (e4m3's subnormals): a float addition of 2^14 rounds the
    # value into the low mantissa bits, and those bits are the code.
    added = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
    subnormal = added - (141 << 23)
    # Normal: rebias the exponent (127 -> 7) and round the mantissa's 20 low
    # bits to nearest-even (c10 adds (7 - 127) << 23 as a wrapping uint32).
    odd = (magnitude >> 20) & 1
    normal = (magnitude - (120 << 23) + 0x7FFFF + odd) >> 20
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    code = tl.where(magnitude >= (1087 << 20), 0x7F, code)  # past 480: NaN, as c10
    return (code | (sign >> 24)).to(tl.uint8)


@triton.jit
def _quantize_rows(x, MAX_CODE: tl.constexpr, IS_INT8: tl.constexpr):
    """Rows [heads, dims] (padding zeros) as (codes as float32, scale per row)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + MAX_CODE)
    divisor = tl.where(scale == 0.0, 1.0, scale)
    y = tl.math.div_rn(x, tl.zeros_like(x) + divisor[:, None])
    if IS_INT8:
        y = (y + _ROUNDER) - _ROUNDER
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y, scale


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_scale_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_CODE: tl.constexpr,  # 0: a model-dtype cache, rows copied
    IS_INT8: tl.constexpr,
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
    # Blocks may be pages apart (a quantized cache): block and offset, not slot * stride.
    block = slot_tile // BLOCK_SIZE
    offset = slot_tile % BLOCK_SIZE
    cache_offsets = (
        block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims
    )
    k = tl.load(
        key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask, other=0.0
    )
    v = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims,
        mask=mask,
        other=0.0,
    )
    if MAX_CODE > 0:
        # One scale per (token, KV head): the first column of each head's row.
        scale_offsets = block * stride_scale_block + offset * stride_scale_slot + heads
        scale_mask = (heads < NUM_KV_HEADS) & (dims == 0) & (slot_tile >= 0)
        k_codes, k_scale = _quantize_rows(k, MAX_CODE, IS_INT8)
        v_codes, v_scale = _quantize_rows(v, MAX_CODE, IS_INT8)
        if IS_INT8:
            k_codes = k_codes.to(tl.int8)
            v_codes = v_codes.to(tl.int8)
        else:  # the caches come as bytes
            k_codes = _e4m3_bits(k_codes)
            v_codes = _e4m3_bits(v_codes)
        tl.store(k_cache_ptr + cache_offsets, k_codes, mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v_codes, mask=mask)
        tl.store(k_scale_ptr + scale_offsets, k_scale[:, None] + tl.zeros_like(k), mask=scale_mask)
        tl.store(v_scale_ptr + scale_offsets, v_scale[:, None] + tl.zeros_like(v), mask=scale_mask)
    else:
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
    quantized = kv_quant.is_quantized(k_cache)
    if not quantized and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the Triton cache writer needs contiguous K/V caches")
    if quantized and k_cache.stride() != v_cache.stride():
        raise ValueError("the Triton cache writer needs K and V pages alike")
    k_scales = kv_quant.cache_scales(k_cache) if quantized else k_cache
    v_scales = kv_quant.cache_scales(v_cache) if quantized else v_cache
    fmt = kv_quant.format_of(k_cache) if quantized else None
    if fmt is kv_quant.FP8_E5M2:
        raise ValueError("the Triton cache writer does not write fp8_e5m2 codes")
    if fmt is kv_quant.FP8_E4M3:
        # Written as their bits (_e4m3_bits).
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales.stride(0),
        k_scales.stride(1) if quantized else 0,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        MAX_CODE=fmt.max_code if fmt is not None else 0.0,
        IS_INT8=fmt is kv_quant.INT8,
    )
