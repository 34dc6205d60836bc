"""The attention backend contract the worker calls, and the per-step metadata it passes.

The worker builds one ``AttentionMetadata`` per step with
``backend.build_metadata(...)`` and hands the same object to every layer's
``backend.forward(...)``. Whatever a backend can precompute once per step
(index tensors, masks, launch grids) lives in ``metadata.plan`` so that 30
layers do not redo it; the worker never looks inside ``plan``.

Batch layout (same as ``kernels/reference.py``): sequences are packed back to
back in ``query``; sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]``
and its queries sit at positions ``context_lens[i] - q_len_i .. context_lens[i] - 1``.
A sequence with one query token is a decode, one with more is a prefill chunk;
they may come in any order. ``build_metadata`` reorders nothing: backends split
decodes from prefill chunks internally and write outputs back in place order.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer's attention needs about one step's batch.

    Tensors live on the device of the KV cache. The two ``max_*`` values are
    host integers so that kernels can size launches without a device sync.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, offsets into query rows
    context_lens: torch.Tensor  # [num_seqs] int32, cached prefix + this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padding never read
    slot_mapping: torch.Tensor  # [num_tokens] int64, negative = do not write
    max_query_len: int
    max_context_len: int
    # Backend-private precomputation (index tensors, masks). A backend that
    # finds a plan it did not build rebuilds its own, so metadata built by one
    # backend still works (slower) with another.
    plan: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def basic_metadata(
    *,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
) -> AttentionMetadata:
    """Metadata without a plan; computes the ``max_*`` values if the caller did not."""
    if query_start_loc.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, "
            f"expected num_seqs + 1 = {context_lens.shape[0] + 1}"
        )
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows for {context_lens.shape[0]} sequences"
        )
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if context_lens.numel() else 0
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )


class AttentionBackend(ABC):
    """Paged-KV attention for one device; stateless, so one instance serves all layers.

    Contract, per step: the worker calls ``build_metadata`` once, then for each
    layer ``write_kv_cache`` with the step's new K/V (so that ``forward`` finds
    every query's own key in the cache) and ``forward``. All methods compute in
    the dtype of their inputs and accumulate softmax in float32.
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device``, or None if it can."""

    @classmethod
    def kv_cache_unsupported_reason(cls, kv_cache_dtype: str) -> str | None:
        """Why this backend cannot run a cache of ``kv_cache_dtype`` (vLLM's
        --kv-cache-dtype name, kernels/kv_quant.py), or None if it can. Every
        backend in the registry writes and reads the quantized formats; one
        that does not overrides this, and the worker refuses it at start-up."""
        return None

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return cls.unsupported_reason(device) is None

    @classmethod
    def build_metadata(
        cls,
        *,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        max_query_len: int | None = None,
        max_context_len: int | None = None,
    ) -> AttentionMetadata:
        """Once per step: the basic tensors plus this backend's precomputed plan.

        Pass ``max_query_len``/``max_context_len`` if known on the host; otherwise
        they are computed here (one device sync on GPU).
        """
        metadata = basic_metadata(
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
        plan = cls.build_plan(metadata)
        return metadata if plan is None else dataclasses.replace(metadata, plan=plan)

    @classmethod
    def build_plan(cls, metadata: AttentionMetadata) -> object | None:
        """This backend's per-step precomputation (index tensors...), or None."""
        return None

    @abstractmethod
    def write_kv_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    ) -> None:
        """Scatter new K/V rows into their cache slots, in place."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output ``[num_tokens, num_heads, head_dim]`` for a mixed batch.

        Per layer: ``sliding_window`` W, each query at position p sees keys
        p - W < j <= p only, and cache blocks wholly before that are never read
        (their block-table entries may be a freed block's null id);
        ``softcap`` c, scores are ``c * tanh(score * scale / c)`` before the
        softmax (kernels/reference.py defines both). None: off."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
