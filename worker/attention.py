"""The worker's single entry point to the attention kernels.

The model calls ``backend.write_kv_cache`` and ``backend.forward`` per layer;
the runner builds one ``AttentionMetadata`` per step with
``backend.build_metadata``. Which backend runs is ``kernels.registry``'s choice.
"""

from __future__ import annotations

import logging

import torch

from kernels.backend import AttentionBackend, AttentionMetadata
from kernels.registry import select_attention_backend

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]


def select_backend(device: str | torch.device, preferred: str | None = None) -> AttentionBackend:
    backend = select_attention_backend(torch.device(device), preferred=preferred)
    logger.info("worker attention backend: %s", backend.name)
    return backend
