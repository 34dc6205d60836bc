"""Fast paged attention with plain torch ops, for CPU (it also runs on any torch device).

Decodes (sequences with one query token) are batched: every decode's context
is gathered through its block table into one padded ``[num_decodes, L, H_kv, D]``
tensor, and one ``scaled_dot_product_attention`` call with a length mask does
them all. GQA costs nothing there: a decode's query heads are viewed as
``[H_kv, group]`` and the group plays the role of the query-length axis.

Prefill chunks (more than one query token) are few per step; each gets one SDPA
call over its gathered prefix + chunk with a causal mask shifted by the cached
prefix length. K/V are expanded over the group as stride-0 views, never copied.

A layer with a sliding window gathers only the keys inside it (a decode: the
last W tokens; a chunk: from its first row's window start), so blocks that
fell out of the window are never read; its masks are built once per step and
window. A soft-capped layer (Gemma 2) computes the scores explicitly (SDPA has
no hook between the product and the softmax): ``c * tanh(s / c)``, masked,
softmax in float32.

Everything derived from the step's batch shape (index tensors, masks) is built
once per step in ``build_metadata`` and reused by all layers, and so are the
buffers the decode gathers K/V into: a fresh multi-megabyte tensor per layer
would cost an mmap, page faults and zeroing 60 times a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvmesh.kernels import kv_quant, reference
from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class LayerOptions:
    """A layer's own attention options (kernels/reference.py): None = off."""

    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class PrefillChunkPlan:
    """One sequence with more than one query token this step."""

    query_start: int  # first query row in the packed batch
    query_end: int
    context_len: int  # cached prefix + chunk
    block_table: torch.Tensor  # [max_blocks_per_seq] of this sequence
    # [q_len, context_len] bool, True = may attend; None when the chunk is the
    # whole context (no cached prefix): SDPA's own causal masking then applies,
    # which skips the masked half (1,024-token chunk: 14.5 vs 20.5 ms per call).
    causal_mask: torch.Tensor | None

    @property
    def query_len(self) -> int:
        return self.query_end - self.query_start


@dataclass(frozen=True)
class CpuAttentionPlan:
    num_tokens: int
    decode_rows: torch.Tensor  # [num_decodes] int64, query row of each decode
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks_per_seq] int64
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_decode_context] bool
    max_decode_context: int
    prefills: tuple[PrefillChunkPlan, ...]
    # The prefill chunks again as arrays, for kernels that take them all in
    # one call: [num_prefills] int64 query starts, query lengths and context
    # lengths, and [num_prefills, max_blocks_per_seq] int64 block tables.
    prefill_query_starts: torch.Tensor
    prefill_query_lens: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    # Slot indices depend on the cache's block size, which the metadata does
    # not carry; they are computed by the first layer and reused by the rest.
    _slots_by_block_size: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # Gather destinations for the decode K/V, shared by all layers of the step.
    _gather_buffers: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)
    # Sliding-window slots and masks, by (what, window, block size): computed
    # by the first layer with that window, reused by the others.
    _window_cache: dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.shape[0]

    def decode_slots(self, block_size: int) -> torch.Tensor:
        """[num_decodes * max_decode_context] cache slots, padding aimed at a valid slot.

        Padding positions point at the sequence's last token (written this step),
        so the gathered rows are always finite; the mask then hides them.
        Pointing them at arbitrary blocks could pull NaN from never-written
        cache memory into ``0 * NaN``.
        """
        slots = self._slots_by_block_size.get(block_size)
        if slots is None:
            positions = torch.arange(self.max_decode_context, device=self.decode_rows.device)
            positions = torch.minimum(positions[None, :], self.decode_context_lens[:, None] - 1)
            block_ids = torch.gather(self.decode_block_tables, 1, positions // block_size)
            slots = (block_ids * block_size + positions % block_size).reshape(-1)
            self._slots_by_block_size[block_size] = slots
        return slots

    def window_decode(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(slots, mask, length) of every decode's last ``window`` keys: slots
        ``[num_decodes * length]`` (padding aimed at the sequence's last token,
        as ``decode_slots``), mask ``[num_decodes, 1, 1, length]``."""
        key = ("decode", window, block_size)
        cached = self._window_cache.get(key)
        if cached is None:
            lens = self.decode_context_lens
            length = min(window, self.max_decode_context)
            starts = (lens - window).clamp(min=0)
            offsets = torch.arange(length, device=lens.device)
            positions = torch.minimum(starts[:, None] + offsets[None, :], lens[:, None] - 1)
            block_ids = torch.gather(self.decode_block_tables, 1, positions // block_size)
            slots = (block_ids * block_size + positions % block_size).reshape(-1)
            mask = offsets[None, :] < (lens - starts)[:, None]
            cached = (slots, mask[:, None, None, :], length)
            self._window_cache[key] = cached
        return cached  # type: ignore[return-value]

    def window_chunk(self, index: int, window: int) -> tuple[int, torch.Tensor]:
        """(first key, mask ``[q_len, context_len - first key]``) of prefill
        chunk ``index`` under a ``window``: keys from its first row's window start."""
        key = ("chunk", index, window)
        cached = self._window_cache.get(key)
        if cached is None:
            chunk = self.prefills[index]
            device = chunk.block_table.device
            q_start = chunk.context_len - chunk.query_len
            first = reference.first_key(q_start, window)
            q_pos = torch.arange(q_start, chunk.context_len, device=device)[:, None]
            k_pos = torch.arange(first, chunk.context_len, device=device)[None, :]
            cached = (first, (k_pos <= q_pos) & (k_pos > q_pos - window))
            self._window_cache[key] = cached
        return cached  # type: ignore[return-value]

    def gather_buffer(self, name: str, like: torch.Tensor, num_rows: int) -> torch.Tensor:
        """A ``[num_rows, *like.shape[2:]]`` scratch tensor, allocated once per step."""
        key = (name, num_rows, like.shape[2:], like.dtype, like.device)
        buffer = self._gather_buffers.get(key)
        if buffer is None:
            buffer = torch.empty((num_rows, *like.shape[2:]), dtype=like.dtype, device=like.device)
            self._gather_buffers[key] = buffer
        return buffer


def build_cpu_plan(metadata: AttentionMetadata) -> CpuAttentionPlan:
    """Split the batch into batched decodes and per-sequence prefill chunks (any order)."""
    device = metadata.context_lens.device
    query_start_loc = metadata.query_start_loc.long()
    context_lens = metadata.context_lens.long()
    query_lens = query_start_loc[1:] - query_start_loc[:-1]

    is_decode = query_lens == 1
    decode_context_lens = context_lens[is_decode]
    max_decode_context = int(decode_context_lens.max()) if decode_context_lens.numel() else 0
    positions = torch.arange(max_decode_context, device=device)
    decode_mask = positions[None, :] < decode_context_lens[:, None]

    is_prefill = query_lens > 1
    prefills = []
    # A short Python loop: only sequences with more than one new token, few per step.
    for seq in torch.nonzero(is_prefill).flatten().tolist():
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        context_len = int(context_lens[seq])
        q_positions = torch.arange(context_len - (end - start), context_len, device=device)
        k_positions = torch.arange(context_len, device=device)
        prefills.append(
            PrefillChunkPlan(
                query_start=start,
                query_end=end,
                context_len=context_len,
                block_table=metadata.block_tables[seq].long(),
                causal_mask=(
                    None
                    if context_len == end - start
                    else k_positions[None, :] <= q_positions[:, None]
                ),
            )
        )
    return CpuAttentionPlan(
        num_tokens=metadata.num_tokens,
        decode_rows=query_start_loc[:-1][is_decode],
        decode_context_lens=decode_context_lens,
        decode_block_tables=metadata.block_tables[is_decode].long(),
        decode_mask=decode_mask[:, None, None, :],
        max_decode_context=max_decode_context,
        prefills=tuple(prefills),
        prefill_query_starts=query_start_loc[:-1][is_prefill],
        prefill_query_lens=query_lens[is_prefill],
        prefill_context_lens=context_lens[is_prefill],
        prefill_block_tables=metadata.block_tables[is_prefill].long(),
    )


def _gather_slots(
    cache: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows ``[len(slots), H_kv, D]`` of a ``[num_blocks, block_size, H_kv, D]``
    cache; a quantized cache's dequantized to ``dtype`` (``out`` unused)."""
    if kv_quant.is_quantized(cache):
        return kv_quant.gather_rows(cache, slots, dtype or torch.float32)
    rows = cache.view(-1, *cache.shape[2:])
    if out is None:
        return rows.index_select(0, slots)
    return torch.index_select(rows, 0, slots, out=out)


def _context_slots(
    block_table: torch.Tensor, context_len: int, block_size: int, first: int = 0
) -> torch.Tensor:
    """Cache slots of positions ``first .. context_len - 1``."""
    positions = torch.arange(first, context_len, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


def attend(
    q: torch.Tensor,  # [..., q_len, D]
    k: torch.Tensor,  # [..., k_len, D]
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,  # bool, True = may attend; None with causal
    causal: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA, or with ``softcap`` the same computed step by step (float32 softmax)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


class CpuAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return None  # torch ops only; on CUDA Triton is preferred but this still runs

    @classmethod
    def build_plan(cls, metadata: AttentionMetadata) -> object:
        return build_cpu_plan(metadata)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if kv_quant.is_quantized(k_cache):
            kv_quant.write_rows(key, value, k_cache, v_cache, slot_mapping)
            return
        if slot_mapping.numel() and bool((slot_mapping >= 0).all()):
            # The worker's case: no skipped tokens, so no boolean masks (each a
            # nonzero + gather) per layer, just two scatters.
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)
            return
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        plan = metadata.plan
        if not isinstance(plan, CpuAttentionPlan):
            plan = build_cpu_plan(metadata)
        if query.shape[0] != plan.num_tokens:
            raise ValueError(f"query has {query.shape[0]} rows, metadata {plan.num_tokens}")
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        layer = LayerOptions(sliding_window, softcap or None)
        if plan.num_decodes:
            self._decode(query, k_cache, v_cache, plan, scale, group, out, layer)
        if plan.prefills:
            self._prefill(query, k_cache, v_cache, plan, scale, group, out, layer)
        return out

    @classmethod
    def _prefill(
        cls,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: CpuAttentionPlan,
        scale: float,
        group: int,
        out: torch.Tensor,
        layer: LayerOptions,
    ) -> None:
        """Every prefill chunk of the step: one SDPA call each."""
        for index, chunk in enumerate(plan.prefills):
            window = None
            if layer.sliding_window is not None:
                window = plan.window_chunk(index, layer.sliding_window)
            cls._prefill_chunk(
                query, k_cache, v_cache, chunk, scale, group, out, window, layer.softcap
            )

    @staticmethod
    def _decode(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: CpuAttentionPlan,
        scale: float,
        group: int,
        out: torch.Tensor,
        layer: LayerOptions,
    ) -> None:
        num_decodes, length = plan.num_decodes, plan.max_decode_context
        num_kv_heads, head_dim = k_cache.shape[2:]
        mask = plan.decode_mask
        if layer.sliding_window is None:
            slots = plan.decode_slots(k_cache.shape[1])
        else:
            slots, mask, length = plan.window_decode(layer.sliding_window, k_cache.shape[1])
        quantized = kv_quant.is_quantized(k_cache)
        # A quantized cache's rows are dequantized into fresh tensors.
        k_rows = None if quantized else plan.gather_buffer("k", k_cache, slots.shape[0])
        v_rows = None if quantized else plan.gather_buffer("v", v_cache, slots.shape[0])
        # [N, L, H_kv, D] -> [N, H_kv, L, D] as a view; SDPA reads the strides.
        k = _gather_slots(k_cache, slots, k_rows, query.dtype).view(
            num_decodes, length, num_kv_heads, head_dim
        )
        v = _gather_slots(v_cache, slots, v_rows, query.dtype).view(
            num_decodes, length, num_kv_heads, head_dim
        )
        q = query.index_select(0, plan.decode_rows).view(num_decodes, num_kv_heads, group, -1)
        attended = attend(
            q, k.transpose(1, 2), v.transpose(1, 2), scale, mask, softcap=layer.softcap
        )
        out.index_copy_(0, plan.decode_rows, attended.reshape(num_decodes, -1, head_dim))

    @staticmethod
    def _prefill_chunk(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunkPlan,
        scale: float,
        group: int,
        out: torch.Tensor,
        window: tuple[int, torch.Tensor] | None = None,
        softcap: float | None = None,
    ) -> None:
        """``window``: (first key, mask) of a sliding-window layer."""
        num_kv_heads, head_dim = k_cache.shape[2:]
        q_len, context_len = chunk.query_len, chunk.context_len
        first, mask = (0, chunk.causal_mask) if window is None else window
        slots = _context_slots(chunk.block_table, context_len, k_cache.shape[1], first)

        def expanded(cache: torch.Tensor) -> torch.Tensor:
            # [keys, H_kv, D] -> [H_kv, group, keys, D] with a stride-0 group axis.
            rows = _gather_slots(cache, slots, dtype=query.dtype).permute(1, 0, 2)
            return rows.unsqueeze(1).expand(num_kv_heads, group, context_len - first, head_dim)

        q = query[chunk.query_start : chunk.query_end].view(q_len, num_kv_heads, group, head_dim)
        attended = attend(
            q.permute(1, 2, 0, 3),
            expanded(k_cache),
            expanded(v_cache),
            scale,
            mask,
            causal=mask is None,
            softcap=softcap,
        )  # [H_kv, group, q_len, D]
        out[chunk.query_start : chunk.query_end] = attended.permute(2, 0, 1, 3).reshape(
            q_len, -1, head_dim
        )
