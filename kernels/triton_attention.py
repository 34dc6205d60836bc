"""Triton paged attention: a decode kernel and a prefill-chunk kernel.

Both read K/V straight from the paged cache through block tables, one cache
block per loop iteration, with an online (flash) softmax in float32.

- Decode: one program per (decode sequence, KV head). The program loads all
  ``group`` query heads that share the KV head, so each K/V byte is read once
  per sequence, whatever the GQA ratio.
- Prefill chunk: one program per (tile of up to ``PREFILL_BLOCK_M`` query rows
  of one sequence, query head). A row at position p sees keys 0..p; the loop
  stops at the tile's last position, so later blocks are never read.

A quantized cache (--kv-cache-dtype int8 / fp8_e4m3, kernels/kv_quant.py)
passes its codes and its per-(token, KV head) float32 scales (a view of the
same pages); each K/V tile is widened to float32 and times its rows' scales
as it is loaded (``QUANTIZED``), the rest of the loop unchanged.

Per layer, a sliding window (``window`` > 0: keys p - window < j <= p) starts
each loop at the block holding the first row's window start, so blocks that
fell out of the window are never read, and a soft-cap (``softcap`` > 0:
scores become ``softcap * tanh(s / softcap)``) applies before the mask.

``tl.dot`` needs every dimension >= 16 on GPUs, so query-head groups are padded
to 16 rows, and the cache block size must be >= 16 (16 and 32 are tested).
Imports triton at module import: load it only through ``kvmesh.kernels.triton_backend``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels import kv_quant

PREFILL_BLOCK_M = 32
_MIN_DOT = 16


@triton.jit
def _soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh as 1 - 2 / (exp(2x) + 1): exact
    +-1 far out (exp overflows to inf, or to 0)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def _dequantize(
    k, v, k_scale_ptr, v_scale_ptr, block, slots, kv_head, valid, stride_block, stride_slot
):
    """A block's code tiles [slots, dims] times their rows' scales (0 where not valid)."""
    offsets = block * stride_block + slots * stride_slot + kv_head
    k_scale = tl.load(k_scale_ptr + offsets, mask=valid, other=0.0)
    v_scale = tl.load(v_scale_ptr + offsets, mask=valid, other=0.0)
    return k * k_scale[:, None], v * v_scale[:, None]


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    decode_rows_ptr,
    decode_seqs_ptr,
    scale,
    window,
    softcap,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_scale_slot,
    QUANTIZED: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(decode_rows_ptr + decode).to(tl.int64)
    seq = tl.load(decode_seqs_ptr + decode).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq)

    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    q_mask = (groups[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + groups
    q = tl.load(
        query_ptr + row * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    ).to(tl.float32)

    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    # 0 without a window (window 0 reads as the whole context).
    first_position = tl.maximum(context_len - tl.where(window > 0, window, context_len), 0)
    for logical_block in range(first_position // BLOCK_SIZE, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table_seq + logical_block).to(tl.int64)
        positions = logical_block * BLOCK_SIZE + slots
        valid = (positions < context_len) & (positions >= first_position)
        offsets = (
            block * stride_cache_block
            + slots[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        # other=0 keeps never-written (possibly NaN) slots out of the sums.
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        if QUANTIZED:
            k, v = _dequantize(
                k, v, k_scale_ptr, v_scale_ptr, block, slots, kv_head, valid,
                stride_scale_block, stride_scale_slot,
            )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if softcap > 0:
            scores = _soft_cap(scores, softcap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + row * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    tile_seqs_ptr,
    tile_rows_ptr,
    scale,
    window,
    softcap,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_scale_slot,
    QUANTIZED: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seqs_ptr + tile).to(tl.int64)
    first_row = tl.load(tile_rows_ptr + tile)
    seq_start = tl.load(query_start_loc_ptr + seq)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - (seq_end - seq_start)

    rows = first_row + tl.arange(0, BLOCK_M)
    row_valid = rows < seq_end
    # Clamp padding rows to the last real row: they then see a real causal
    # window (never an all-masked one, which would divide 0 by 0).
    q_positions = prefix_len + tl.minimum(rows, seq_end - 1) - seq_start
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    q_mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    rows64 = rows.to(tl.int64)
    q = tl.load(
        query_ptr + rows64[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    ).to(tl.float32)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    last_position = tl.max(q_positions, 0)
    # Keys at or before `lowest` are outside the row's window (-1: no window).
    lowest = tl.where(window > 0, q_positions - window, -1)
    first_block = tl.maximum(tl.min(lowest, 0) + 1, 0) // BLOCK_SIZE
    for logical_block in range(first_block, tl.cdiv(last_position + 1, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table_seq + logical_block).to(tl.int64)
        k_positions = logical_block * BLOCK_SIZE + slots
        k_valid = k_positions < context_len
        offsets = (
            block * stride_cache_block
            + slots[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        kv_mask = k_valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        if QUANTIZED:
            k, v = _dequantize(
                k, v, k_scale_ptr, v_scale_ptr, block, slots, kv_head, k_valid,
                stride_scale_block, stride_scale_slot,
            )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if softcap > 0:
            scores = _soft_cap(scores, softcap)
        visible = (
            k_valid[None, :]
            & (k_positions[None, :] <= q_positions[:, None])
            & (k_positions[None, :] > lowest[:, None])
        )
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # A row whose window starts past this block sees none of it: its max
        # stays -inf, and exp(-inf - -inf) would be NaN; 0 makes its terms 0.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + rows64[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized cache's scale views (kernels/kv_quant.py); the caches themselves
    otherwise (never read: QUANTIZED is off)."""
    if not kv_quant.is_quantized(k_cache):
        return k_cache, v_cache
    return kv_quant.cache_scales(k_cache), kv_quant.cache_scales(v_cache)


def _scale_strides(k_cache: torch.Tensor) -> tuple[int, int]:
    if not kv_quant.is_quantized(k_cache):
        return 0, 0
    scales = kv_quant.cache_scales(k_cache)
    return scales.stride(0), scales.stride(1)


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA group size, after checking what the kernels assume."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.shape[1] < _MIN_DOT:
        raise ValueError(f"Triton attention needs block_size >= {_MIN_DOT}, got {k_cache.shape[1]}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share a layout with contiguous head_dim")
    return num_heads // num_kv_heads


def paged_decode(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at decode rows only
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], stride(-1) == 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    decode_rows: torch.Tensor,  # [num_decodes] int32, query row of each decode
    decode_seqs: torch.Tensor,  # [num_decodes] int32, its sequence index
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    group = _check_layout(query, k_cache, v_cache)
    num_decodes, num_kv_heads, head_dim = decode_rows.shape[0], k_cache.shape[2], query.shape[2]
    if num_decodes == 0:
        return
    _paged_decode_kernel[(num_decodes, num_kv_heads)](
        out,
        query,
        k_cache,
        v_cache,
        *_scales(k_cache, v_cache),
        block_tables,
        context_lens,
        decode_rows,
        decode_seqs,
        scale,
        sliding_window or 0,
        float(softcap or 0.0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *_scale_strides(k_cache),
        QUANTIZED=kv_quant.is_quantized(k_cache),
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
    )


def paged_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    tile_seqs: torch.Tensor,  # [num_tiles] int32, sequence of each query tile
    tile_rows: torch.Tensor,  # [num_tiles] int32, first query row of each tile
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    group = _check_layout(query, k_cache, v_cache)
    num_tiles, num_heads, head_dim = tile_seqs.shape[0], query.shape[1], query.shape[2]
    if num_tiles == 0:
        return
    _paged_prefill_kernel[(num_tiles, num_heads)](
        out,
        query,
        k_cache,
        v_cache,
        *_scales(k_cache, v_cache),
        block_tables,
        context_lens,
        query_start_loc,
        tile_seqs,
        tile_rows,
        scale,
        sliding_window or 0,
        float(softcap or 0.0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *_scale_strides(k_cache),
        QUANTIZED=kv_quant.is_quantized(k_cache),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M,
    )
