"""The CPU path with decode attention in C++ (``kernels/csrc/paged_attention_cpu.cpp``).

Same plan as ``cpu`` (kernels/cpu_attention.py); the batched decode differs,
and from the avx2 level up so do prefill chunks (below). For decodes,
the torch path gathers every decode's context into a padded tensor (a copy
of all K/V rows per layer) and runs a masked SDPA whose query length is the
GQA group; this backend reads K/V in place through the block tables, skips
padding, and splits (sequence, KV head) pairs over torch's threads — about
5x less time per layer for SmolLM2-135M at batch 16
(benchmarks/attention_bench.py).

Refused (with the reason) when the ops cannot be built or loaded: no
compiler, ``KVMESH_NATIVE_KERNELS=0``, a non-CPU device. float32 and bfloat16
run in C++ (bfloat16 q and K/V with float32 softmax and accumulation, one
rounding of the output); other dtypes fall back to the torch decode path per
call.

Prefill chunks run ``paged_prefill_attention``
(kernels/csrc/prefill_attention_cpu.cpp) in float32 from the avx2 level up
and in bfloat16 where the level multiplies bfloat16 pairs in hardware
(``avx512_bf16``: vdpbf16ps; ``amx``: AMX tiles): all chunks of the step in
one call, K/V read through the block tables, Q K^T and P V with a float32
online softmax, instead of one torch SDPA per chunk over gathered K/V (whose
bfloat16 matmuls run off AMX and off vdpbf16ps). Other dtypes, levels and
head sizes take the torch path.

In batch-invariant mode (kernels/batch_invariant.py) every query row, of
prompt chunks and decodes alike, runs ``paged_decode_attention`` over its own
context with fixed-length runs (kernels/invariant_attention.py).

New K/V rows go into the cache with one ``write_kv_cache`` call per layer
(kernels/csrc/kv_cache_write_cpu.cpp) instead of a negative-slot check and
two ``index_copy_``; a cache of another dtype or layout takes the torch path.

A quantized cache (--kv-cache-dtype int8 / fp8, kernels/kv_quant.py) runs the
same ops: the write quantizes each (token, KV head) row into its page's codes
and scale, decode attention dequantizes K and V rows in registers (a score
times its K row's scale, a probability times its V row's), and prefill packs
the dequantized rows (kernels/csrc/kv_codes.h).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvmesh.kernels import batch_invariant, kv_quant, native
from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.cpu_attention import (
    CpuAttentionBackend,
    CpuAttentionPlan,
    LayerOptions,
    build_cpu_plan,
)
from kvmesh.kernels.invariant_attention import EveryRowPlan, attend_every_row, every_row_plan

# paged_prefill_attention's head sizes: whole 32-dim operand rows (an AMX tile
# row, 16 bfloat16 pairs), at most 256.
_HEAD_DIM_MULTIPLE = 32
_MAX_HEAD_DIM = 256


class NativeCpuAttentionBackend(CpuAttentionBackend):
    name: ClassVar[str] = "cpu_native"

    def __init__(self) -> None:
        native.ensure_loaded()  # builds and loads the ops, or says why it cannot

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"C++ kernels run on CPU tensors only, not {device.type}"
        reason = native.unavailable_reason()
        return None if reason is None else f"C++ kernels unavailable: {reason}"

    @classmethod
    def build_plan(cls, metadata: AttentionMetadata) -> object:
        if batch_invariant.enabled():
            return every_row_plan(metadata)
        return build_cpu_plan(metadata)

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
        if not batch_invariant.enabled():
            return super().forward(
                query,
                k_cache,
                v_cache,
                metadata,
                scale,
                sliding_window=sliding_window,
                softcap=softcap,
            )
        plan = metadata.plan
        if not isinstance(plan, EveryRowPlan):
            plan = every_row_plan(metadata)
        return attend_every_row(
            query, k_cache, v_cache, plan, scale, LayerOptions(sliding_window, softcap or None)
        )

    def one_decode_row_tables(
        self,
        metadata: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(block tables, context lengths, query rows): paged_decode_attention's
        tables when the step is one decode token that ``forward`` and
        ``write_kv_cache`` would hand to their C++ ops as they are (dense
        ``dtype`` caches, the kernels' own plan), for a layer that makes those
        calls itself (kvmesh::ggml_llama_layer_row); None otherwise."""
        plan = metadata.plan
        slots = metadata.slot_mapping
        fits = (
            not batch_invariant.enabled()
            and isinstance(plan, CpuAttentionPlan)
            and plan.num_tokens == 1
            and plan.num_decodes == 1
            and not plan.prefills
            and dtype in native.NATIVE_DTYPES
            and k_cache.dtype == v_cache.dtype == dtype
            and k_cache.is_cpu
            and k_cache.dim() == 4
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and slots.dtype == torch.int64
            and slots.is_contiguous()
        )
        if not fits:
            return None
        assert isinstance(plan, CpuAttentionPlan)
        return plan.decode_block_tables, plan.decode_context_lens, plan.decode_rows

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if _native_write_fits(key, value, k_cache, v_cache, slot_mapping):
            torch.ops.kvmesh.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        super().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

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
        if (
            query.dtype not in native.NATIVE_DTYPES
            or not _reads_cache(query, k_cache)
            or not query.is_cpu
        ):
            CpuAttentionBackend._decode(query, k_cache, v_cache, plan, scale, group, out, layer)
            return
        torch.ops.kvmesh.paged_decode_attention(
            out,
            query,
            k_cache,
            v_cache,
            plan.decode_block_tables,
            plan.decode_context_lens,
            plan.decode_rows,
            scale,
            0,
            layer.sliding_window or 0,
            layer.softcap or 0.0,
        )

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
        head_dim = query.shape[2]
        if (
            query.dtype not in native.prefill_attention_dtypes()
            or not _reads_cache(query, k_cache)
            or not query.is_cpu
            or head_dim % _HEAD_DIM_MULTIPLE
            or head_dim > _MAX_HEAD_DIM
        ):
            CpuAttentionBackend._prefill(query, k_cache, v_cache, plan, scale, group, out, layer)
            return
        torch.ops.kvmesh.paged_prefill_attention(
            out,
            query,
            k_cache,
            v_cache,
            plan.prefill_block_tables,
            plan.prefill_query_starts,
            plan.prefill_query_lens,
            plan.prefill_context_lens,
            scale,
            layer.sliding_window or 0,
            layer.softcap or 0.0,
        )


def _reads_cache(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ attention ops read ``k_cache`` for ``query``: a cache of
    the query's dtype, or a quantized one (codes and scales, dequantized in
    registers)."""
    return k_cache.dtype == query.dtype or kv_quant.is_quantized(k_cache)


def _dense_rows(rows: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] whose per-token part is one dense row."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def _native_write_fits(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Whether kvmesh::write_kv_cache takes these (its checks, asked up front):
    rows in the cache's dtype, or float32/bfloat16 rows into a quantized cache's
    pages (kernels/kv_quant.py, whose layout the op checks)."""
    if kv_quant.is_quantized(k_cache):
        return (
            _dense_rows(key)
            and _dense_rows(value)
            and key.dtype == value.dtype
            and key.dtype in native.NATIVE_DTYPES
            and v_cache.dtype == k_cache.dtype
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
        )
    return (
        _dense_rows(key)
        and _dense_rows(value)
        and k_cache.dim() == 4
        and key.dtype == k_cache.dtype == value.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
    )
