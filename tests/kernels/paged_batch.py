"""Random paged-attention batches for kernel tests and benchmarks.

A batch is described by ``(num_cached_tokens, num_new_tokens)`` per sequence.
Cached tokens are already in the cache; new tokens come as ``key``/``value``
rows the caller writes with ``write_kv_cache`` before ``forward``. Blocks are
handed out in a shuffled order so that logical and physical order differ, the
cache starts as NaN so a kernel that reads a slot it should not poisons its
output, and block-table padding is an out-of-range id so reading it fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata
from kvmesh.services.contracts.math_utils import cdiv


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's new K
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    scale: float

    def metadata(self, backend: AttentionBackend | type[AttentionBackend]) -> AttentionMetadata:
        return backend.build_metadata(
            query_start_loc=self.query_start_loc,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
        )

    def fresh_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches, so that two backends can write into their own."""
        return self.k_cache.clone(), self.v_cache.clone()

    def with_query_scaled(self, factor: float) -> PagedBatch:
        """The same batch with every query times ``factor`` (scores times it too)."""
        return replace(self, query=self.query * factor)

    def to_float32(self) -> PagedBatch:
        """The same values in float32: a reference for a lower-precision kernel."""
        return replace(
            self,
            **{
                name: getattr(self, name).float()
                for name in ("query", "key", "value", "k_cache", "v_cache")
            },
        )


def run_backend(
    backend: AttentionBackend,
    batch: PagedBatch,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Writes the batch's new K/V into fresh caches with ``backend``, then runs its forward."""
    k_cache, v_cache = batch.fresh_caches()
    metadata = batch.metadata(backend)
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    return backend.forward(
        batch.query,
        k_cache,
        v_cache,
        metadata,
        batch.scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )


def null_block_id(batch: PagedBatch) -> int:
    """A block no sequence owns, never written: all NaN (a spare block)."""
    owned = set(batch.block_tables.flatten().tolist())
    return next(b for b in range(batch.k_cache.shape[0]) if b not in owned)


def free_out_of_window(batch: PagedBatch, window: int, null_block: int | None = None) -> PagedBatch:
    """The batch with each sequence's blocks wholly before its first query's
    window replaced by ``null_block`` (default: a never-written, NaN block), as
    the scheduler frees them: a kernel that reads one poisons its output (or,
    for an out-of-range id, fails)."""
    null = null_block_id(batch) if null_block is None else null_block
    tables = batch.block_tables.clone()
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for seq, context in enumerate(batch.context_lens.tolist()):
        first_query = context - (starts[seq + 1] - starts[seq])
        first_block = max(0, first_query - window + 1) // block_size
        tables[seq, :first_block] = null
    return replace(batch, block_tables=tables)


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """A batch with one sequence per ``(num_cached_tokens, num_new_tokens)`` entry."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device, dtype)

    blocks_per_seq = [cdiv(cached + new, block_size) for cached, new in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 2  # room for padding columns
    out_of_range = num_blocks + 1000
    block_tables = torch.full((len(seqs), max_blocks), out_of_range, dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)

    new_slots: list[int] = []
    query_start_loc = [0]
    for seq, (cached, new) in enumerate(seqs):
        owned = [physical.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        slots = [
            owned[pos // block_size] * block_size + pos % block_size for pos in range(cached + new)
        ]
        if cached:
            cached_slots = torch.tensor(slots[:cached], device=device)
            flat_k[cached_slots] = randn(cached, num_kv_heads, head_dim)
            flat_v[cached_slots] = randn(cached, num_kv_heads, head_dim)
        new_slots.extend(slots[cached:])
        query_start_loc.append(query_start_loc[-1] + new)

    num_tokens = query_start_loc[-1]
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(
            [cached + new for cached, new in seqs], dtype=torch.int32, device=device
        ),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
        scale=head_dim**-0.5,
    )


# Named batch shapes, as (num_cached_tokens, num_new_tokens) per sequence.
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    # Ragged decodes; several contexts end mid-block, one exactly on a boundary.
    "decodes_ragged": [(0, 1), (4, 1), (16, 1), (31, 1), (40, 1), (70, 1)],
    # A fresh prompt that fills part of its last block.
    "prefill_fresh": [(0, 21)],
    # A chunk on top of a cached prefix that itself ends mid-block.
    "chunk_on_cached_prefix": [(19, 13)],
    # Decodes and prefill chunks interleaved, not decodes-first.
    "mixed_any_order": [(9, 1), (0, 7), (33, 1), (12, 5), (1, 1), (0, 2), (47, 1)],
}
# Contexts longer than the sliding windows the tests use (5 to 37 tokens):
# decodes far past the window, a fresh prompt longer than it, chunks on
# prefixes, in any order, with a context shorter than the window among them.
WINDOW_SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "window_decodes": [(0, 1), (3, 1), (40, 1), (70, 1), (101, 1), (16, 1)],
    "window_prefill_fresh": [(0, 45)],
    "window_chunks": [(30, 20), (64, 17), (5, 3)],
    "window_mixed": [(90, 1), (0, 50), (33, 1), (48, 40), (2, 1)],
}
