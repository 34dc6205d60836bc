"""The paged KV cache tensors a worker owns (one K and one V tensor per layer)."""

from __future__ import annotations

import logging

import torch

from kvmesh.worker.config import ModelConfig

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    num_kv_heads: int | None = None,
    num_layers: int | None = None,
) -> list[KVCache]:
    """Per layer, K and V as ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    ``num_kv_heads``/``num_layers``: a tensor/pipeline-parallel rank's share
    (default: the whole model's). Zero-filled rather than empty: padding slots
    that a kernel might read past a context's end then hold finite values
    instead of NaNs from stale memory.
    """
    heads = num_kv_heads or model_config.num_kv_heads
    shape = (num_blocks, block_size, heads, model_config.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=model_config.dtype, device=device),
            torch.zeros(shape, dtype=model_config.dtype, device=device),
        )
        for _ in range(num_layers or model_config.num_layers)
    ]
    total_bytes = 2 * len(caches) * caches[0][0].numel() * caches[0][0].element_size()
    logger.info(
        "allocated KV cache: %s blocks x %s tokens, %.1f MiB",
        num_blocks,
        block_size,
        total_bytes / 2**20,
    )
    return caches
