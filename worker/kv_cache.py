"""The paged KV cache tensors a worker owns (one K and one V tensor per layer).

With KV-cache groups (services/contracts/kv_cache_groups.py) the layers at
position j of every group share tensor pair j: a block id belongs to one
group at a time, so the groups' pages never overlap, and a block of the pool
costs ``group_size`` layers instead of every layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.kernels import kv_quant
from kvmesh.services.contracts.kv_cache_groups import (
    KVCacheGroup,
    group_layers,
    group_size,
    layer_slots,
)
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.declaration import LayerKVSpec

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    num_kv_heads: int | None = None,
    num_layers: int | None = None,
    kv_format: kv_quant.KVCacheFormat | None = None,
) -> list[KVCache]:
    """Per layer, K and V as ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    ``num_kv_heads``/``num_layers``: a tensor/pipeline-parallel rank's share
    (default: the whole model's). Zero-filled rather than empty: padding slots
    that a kernel might read past a context's end then hold finite values
    instead of NaNs from stale memory. ``kv_format``: a quantized cache
    (--kv-cache-dtype), each tensor the codes' view of its pages of codes and
    scales (kernels/kv_quant.py); None: the model dtype.
    """
    heads = num_kv_heads or model_config.num_kv_heads
    shape = (num_blocks, block_size, heads, model_config.head_dim)

    def one() -> torch.Tensor:
        if kv_format is None:
            return torch.zeros(shape, dtype=model_config.dtype, device=device)
        return kv_quant.allocate_pages(kv_format, *shape, device=device)

    caches = [(one(), one()) for _ in range(num_layers or model_config.num_layers)]
    pages = kv_quant.cache_pages(caches[0][0])
    total_bytes = 2 * len(caches) * pages.numel() * pages.element_size()
    logger.info(
        "allocated KV cache: %s blocks x %s tokens, %s, %.1f MiB",
        num_blocks,
        block_size,
        kv_format.store_name if kv_format else str(model_config.dtype).removeprefix("torch."),
        total_bytes / 2**20,
    )
    return caches


def model_kv_cache_groups(
    specs: Sequence[LayerKVSpec], max_model_len: int
) -> tuple[KVCacheGroup, ...]:
    """The model's KV-cache groups from its per-layer spec. A window at least
    ``max_model_len`` long is full attention (it would never free a block), so
    such a model keeps one group and its cache exactly as without windows."""
    return group_layers(
        [
            s.sliding_window
            if s.sliding_window is not None and s.sliding_window < max_model_len
            else None
            for s in specs
        ]
    )


def allocate_group_kv_caches(
    model_config: ModelConfig,
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    num_kv_heads: int | None = None,
    kv_format: kv_quant.KVCacheFormat | None = None,
) -> list[KVCache]:
    """Per model layer, its (K, V): the tensor pair of its position in its group
    (one pair per layer when there is one group)."""
    pairs = allocate_kv_caches(
        model_config,
        num_blocks,
        block_size,
        device,
        num_kv_heads=num_kv_heads,
        num_layers=group_size(groups),
        kv_format=kv_format,
    )
    return [pairs[slot] for _, slot in layer_slots(groups, model_config.num_layers)]
