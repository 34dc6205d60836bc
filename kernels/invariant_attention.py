"""Attention in batch-invariant mode: every query row as a decode of its own context.

A prompt chunk's row i (prefix of P tokens) attends to keys 0..P+i, exactly
what a decode at that position attends to. Giving every row of the step, of
prompt chunks and decodes alike, to ``paged_decode_attention`` with runs of a
fixed length (``batch_invariant.RUN_TOKENS`` from token 0) sums each row in
one order that depends only on its context: not on the batch, on how the
prompt was chunked, on whether its prefix came from the cache, or on a
recompute after preemption (kernels/batch_invariant.py says why the usual
paths differ). A prompt's rows each cost a decode's attention (K/V read per
row, no query tiling). A quantized cache (--kv-cache-dtype) is read the same
way: the kernel dequantizes each row in registers, in one order per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kernels import batch_invariant, kv_quant, native
from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.cpu_attention import LayerOptions


@dataclass(frozen=True)
class EveryRowPlan:
    """Each query row of the step as a decode; built once per step."""

    num_tokens: int
    rows: torch.Tensor  # [num_rows] int64, query row
    context_lens: torch.Tensor  # [num_rows] int64, keys the row sees (its position + 1)
    block_tables: torch.Tensor  # [num_rows, max_blocks_per_seq] int64, its sequence's table


def every_row_plan(metadata: AttentionMetadata) -> EveryRowPlan:
    query_start_loc = metadata.query_start_loc.long()
    context_lens = metadata.context_lens.long()
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of = torch.repeat_interleave(torch.arange(context_lens.shape[0]), query_lens)
    rows = torch.arange(int(query_start_loc[-1]) if query_start_loc.numel() else 0)
    index_in_chunk = rows - query_start_loc[:-1][seq_of]
    prefix = context_lens[seq_of] - query_lens[seq_of]
    return EveryRowPlan(
        num_tokens=metadata.num_tokens,
        rows=rows,
        context_lens=prefix + index_in_chunk + 1,
        block_tables=metadata.block_tables.long()[seq_of].contiguous(),
    )


def attend_every_row(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: EveryRowPlan,
    scale: float,
    layer: LayerOptions | None = None,
) -> torch.Tensor:
    """``softmax(q K^T * scale) V`` for every row of ``query`` ([tokens, heads, head_dim]).

    ``layer``'s sliding window starts each row's context at its own window
    start (a function of its position only, so still batch-invariant: runs
    stay aligned to ``RUN_TOKENS`` from token 0, the first one cut there)."""
    layer = layer or LayerOptions()
    if query.shape[0] != plan.num_tokens:
        raise ValueError(f"query has {query.shape[0]} rows, metadata {plan.num_tokens}")
    if query.dtype not in native.NATIVE_DTYPES or not (
        k_cache.dtype == query.dtype or kv_quant.is_quantized(k_cache)
    ):
        raise ValueError(
            f"batch-invariant attention runs float32 or bfloat16 with a cache of the same "
            f"dtype or a quantized one, not {query.dtype} over a {k_cache.dtype} cache"
        )
    out = torch.empty_like(query)
    if plan.rows.numel():
        torch.ops.kvmesh.paged_decode_attention(
            out,
            query,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.context_lens,
            plan.rows,
            scale,
            batch_invariant.RUN_TOKENS,
            layer.sliding_window or 0,
            layer.softcap or 0.0,
        )
    return out
