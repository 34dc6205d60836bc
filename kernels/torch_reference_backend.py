"""The slow, obviously-correct backend: ``kernels/reference.py`` behind the backend contract.

It is the oracle the tests compare other backends against, and the fallback
on any device. One Python iteration per sequence: never use it for serving.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvmesh.kernels import reference
from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    name: ClassVar[str] = "torch_reference"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return None  # plain torch ops run on any device

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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # Decode is the q_len == 1 case of the prefill reference, so one call
        # covers a mixed batch in any order.
        return reference.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            scale,
            sliding_window,
            softcap,
        )
