"""Triton attention backend for CUDA (and for tests, Triton's CPU interpreter).

This module never imports triton itself: the kernel modules are imported on
first use, so ``kernels`` imports fine where triton is missing, and the
``TRITON_INTERPRET`` setting in force at that moment decides, for the life of
the process, whether kernels compile for a GPU or run in the interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from kvmesh.kernels import kv_quant
from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata
from kvmesh.services.runtime.config.process import TRITON_INTERPRET


def triton_interpret_enabled() -> bool:
    """Whether Triton kernels run in its CPU interpreter (read when kernels are first imported)."""
    return TRITON_INTERPRET.get()


def _kernels(name: str) -> ModuleType:
    return importlib.import_module(f"kvmesh.kernels.{name}")


@dataclass(frozen=True)
class TritonAttentionPlan:
    num_tokens: int
    decode_rows: torch.Tensor  # [num_decodes] int32, query row of each decode
    decode_seqs: torch.Tensor  # [num_decodes] int32, its sequence index
    tile_seqs: torch.Tensor  # [num_tiles] int32, sequence of each prefill query tile
    tile_rows: torch.Tensor  # [num_tiles] int32, first query row of each tile


def build_triton_plan(metadata: AttentionMetadata, block_m: int) -> TritonAttentionPlan:
    """Decode list and prefill tiling, computed on the host (one small copy per step)."""
    device = metadata.context_lens.device
    query_start_loc = metadata.query_start_loc.cpu().long()
    starts = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - starts
    is_decode = query_lens == 1
    is_prefill = query_lens > 1
    tiles_per_seq = (query_lens + block_m - 1) // block_m * is_prefill
    tile_seqs = torch.repeat_interleave(torch.arange(query_lens.shape[0]), tiles_per_seq)
    # Index of each tile within its sequence: running count minus the sequence's first tile.
    first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_index = torch.arange(tile_seqs.shape[0]) - first_tile[tile_seqs]
    tile_rows = starts[tile_seqs] + tile_index * block_m

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int32)

    return TritonAttentionPlan(
        num_tokens=metadata.num_tokens,
        decode_rows=to_device(starts[is_decode]),
        decode_seqs=to_device(torch.nonzero(is_decode).flatten()),
        tile_seqs=to_device(tile_seqs),
        tile_rows=to_device(tile_rows),
    )


class TritonAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "triton"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret_enabled():
            return None
        return f"device {device} is not CUDA and TRITON_INTERPRET is not set"

    @classmethod
    def kv_cache_unsupported_reason(cls, kv_cache_dtype: str) -> str | None:
        if kv_quant.resolve(kv_cache_dtype) is not kv_quant.FP8_E5M2:
            return None
        return (
            "fp8_e5m2 is not implemented in the Triton kernels (its codes could not be checked "
            "against torch's rounding under the interpreter); use int8 or fp8_e4m3"
        )

    @classmethod
    def build_plan(cls, metadata: AttentionMetadata) -> object:
        block_m = _kernels("triton_attention").PREFILL_BLOCK_M
        return build_triton_plan(metadata, block_m)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _kernels("triton_cache").write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

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
        attention = _kernels("triton_attention")
        plan = metadata.plan
        if not isinstance(plan, TritonAttentionPlan):
            plan = build_triton_plan(metadata, attention.PREFILL_BLOCK_M)
        if query.shape[0] != plan.num_tokens:
            raise ValueError(f"query has {query.shape[0]} rows, metadata {plan.num_tokens}")
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        tables, context_lens = metadata.block_tables, metadata.context_lens
        attention.paged_decode(
            out, query, k_cache, v_cache, tables, context_lens,
            plan.decode_rows, plan.decode_seqs, scale, sliding_window, softcap,
        )  # fmt: skip
        attention.paged_prefill(
            out, query, k_cache, v_cache, tables, context_lens,
            metadata.query_start_loc, plan.tile_seqs, plan.tile_rows, scale,
            sliding_window, softcap,
        )  # fmt: skip
        return out
