"""The worker's view of the attention kernels.

The model only needs two calls per layer: write this step's K/V into the paged
cache, then attend. ``kernels.registry`` picks the fastest backend for a device;
until that module exists this adapter serves the plain reference kernels from
``kernels.reference`` with the same interface, so the model code never changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import reference

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and context live for one step."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32: cached tokens + this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_context_len: int


class AttentionBackend(Protocol):
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class ReferenceAttentionBackend:
    """kernels.reference behind the backend interface (slow: a Python loop per sequence)."""

    name = "reference"

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            scale,
        )

    def build_metadata(self, **fields: object) -> AttentionMetadata:
        return AttentionMetadata(**fields)  # type: ignore[arg-type]


def select_backend(device: str | torch.device, preferred: str | None = None) -> AttentionBackend:
    """The registry's choice for ``device``, or the reference adapter if there is no registry."""
    try:
        from kernels.registry import select_attention_backend
    except ImportError:
        if preferred not in (None, "reference"):
            raise ValueError(
                f"attention backend {preferred!r} requested but kernels.registry is missing"
            ) from None
        logger.info("kernels.registry not available; using the reference attention kernels")
        return ReferenceAttentionBackend()
    if preferred == "reference":
        return ReferenceAttentionBackend()
    return select_attention_backend(torch.device(device), preferred=preferred)


def build_metadata(backend: AttentionBackend, **fields: object) -> AttentionMetadata:
    """Metadata in the backend's own type when it has a factory."""
    factory = getattr(backend, "build_metadata", None)
    if factory is None:
        return AttentionMetadata(**fields)  # type: ignore[arg-type]
    return factory(**fields)
