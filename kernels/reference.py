"""Plain PyTorch reference kernels for the paged KV cache.

These define what every other backend (the fast CPU path, Triton) must
compute; tests compare against them. They favour clarity over speed.

Cache layout (per layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset_in_block``. A request's *block table* lists
its physical block ids in logical order, padded with any value (never read)
past the blocks it owns.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot means "skip"
) -> None:
    """Scatter new K/V rows into their cache slots, in place."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = value[keep]


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim] of one request, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int):
    """Causal attention of queries at positions q_start.. over keys 0..len(k)-1.

    q: [q_len, H, D]; k, v: [ctx, H_kv, D]. GQA: each KV head serves H/H_kv query heads.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    # Positions on q's device: a CPU mask cannot index a CUDA score tensor.
    q_pos = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + q_start
    k_pos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. the query's own
    scale: float,
) -> torch.Tensor:
    """Each sequence's single new token attends to its whole cached context."""
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        ctx = int(context_lens[i])
        k = _gather_context(k_cache, block_tables[i], ctx)
        v = _gather_context(v_cache, block_tables[i], ctx)
        out[i] = _attend(query[i : i + 1], k, v, scale, q_start=ctx - 1)[0]
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into query
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk
    scale: float,
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
        ctx = int(context_lens[i])
        k = _gather_context(k_cache, block_tables[i], ctx)
        v = _gather_context(v_cache, block_tables[i], ctx)
        out[start:end] = _attend(query[start:end], k, v, scale, q_start=ctx - (end - start))
    return out
