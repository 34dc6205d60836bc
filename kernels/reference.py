"""Plain PyTorch reference kernels for the paged KV cache.

These define what every other backend (the fast CPU path, Triton) must
compute; tests compare against them. They favour clarity over speed.

Cache layout (per layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset_in_block``. A request's *block table* lists
its physical block ids in logical order, padded with any value (never read)
past the blocks it owns.

Two per-layer options every backend implements (``AttentionMetadata``'s
batch is the same for all layers; these differ by layer):

- ``sliding_window`` W: the query at position p sees keys j with
  ``p - W < j <= p`` (transformers' mask for Mistral, Gemma 2/3). Blocks wholly
  before the window are never read: the scheduler may have freed them and put
  a null id in their block-table entries.
- ``softcap`` c: scores become ``c * tanh(scores / c)`` after the scale and
  before the mask and softmax (Gemma 2's ``attn_logit_softcapping``).
"""

from __future__ import annotations

import torch

from kvmesh.kernels import kv_quant


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot means "skip"
) -> None:
    """Scatter new K/V rows into their cache slots, in place (a quantized
    cache, kernels/kv_quant.py: their codes and scales)."""
    if kv_quant.is_quantized(k_cache):
        kv_quant.write_rows(key, value, k_cache, v_cache, slot_mapping)
        return
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = value[keep]


def first_key(q_start: int, sliding_window: int | None) -> int:
    """The oldest key position a query at ``q_start`` (or later) may see."""
    return 0 if sliding_window is None else max(0, q_start - sliding_window + 1)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, first_block: int = 0
) -> torch.Tensor:
    """Keys ``first_block * block_size .. context_len - 1`` of one request, read
    through its block table: ``[n, num_kv_heads, head_dim]`` (a quantized
    cache's dequantized to float32)."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    ids = block_table[first_block:num_blocks].long()
    blocks = cache[ids]  # [n, block_size, H, D]
    if kv_quant.is_quantized(cache):
        blocks = kv_quant.dequantize(blocks, kv_quant.cache_scales(cache)[ids], torch.float32)
    return blocks.reshape(-1, *cache.shape[2:])[: context_len - first_block * block_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_start: int,
    k_start: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
):
    """Causal attention of queries at positions q_start.. over keys at k_start..

    q: [q_len, H, D]; k, v: [ctx - k_start, H_kv, D]. GQA: each KV head serves
    H/H_kv query heads. ``sliding_window``/``softcap``: the module docstring.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # Positions on q's device: a CPU mask cannot index a CUDA score tensor.
    q_pos = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + q_start
    k_pos = torch.arange(k.shape[0], device=q.device).unsqueeze(0) + k_start
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the query's own
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each sequence's single new token attends to its cached context (its window's part)."""
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        ctx = int(context_lens[i])
        out[i : i + 1] = _attend_sequence(
            query[i : i + 1], k_cache, v_cache, block_tables[i], ctx, scale, sliding_window, softcap
        )
    return out


def _attend_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence's query rows (the last ``len(q)`` positions of its context)."""
    q_start = context_len - q.shape[0]
    first_block = first_key(q_start, sliding_window) // k_cache.shape[1]
    k = _gather_context(k_cache, block_table, context_len, first_block)
    v = _gather_context(v_cache, block_table, context_len, first_block)
    k_start = first_block * k_cache.shape[1]
    return _attend(q, k, v, scale, q_start, k_start, sliding_window, softcap)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into query
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per sequence attends to its cached prefix plus itself, causally.

    The chunk's own K/V must already be written into the cache. Sequence i's
    queries sit at positions ``context_lens[i] - q_len_i .. context_lens[i] - 1``.
    Decode is the special case q_len = 1.
    """
    out = torch.empty_like(query)
    for i in range(block_tables.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end == start:
            continue
        out[start:end] = _attend_sequence(
            query[start:end],
            k_cache,
            v_cache,
            block_tables[i],
            int(context_lens[i]),
            scale,
            sliding_window,
            softcap,
        )
    return out
