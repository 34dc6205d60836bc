"""How a worker's KV blocks look in the kvstore: their layout tag and their bytes.

Layout version 1: a block's bytes are, for each layer in order, K[block] then
V[block], each ``[block_size, num_kv_heads, head_dim]`` in the cache dtype and
C-contiguous, concatenated; a quantized cache's (--kv-cache-dtype,
kernels/kv_quant.py) K[block] and V[block] are each the block's whole page,
its codes then its float32 scales, and the layout's dtype names the format
(``int8+scale_per_token_head``...), so a store never serves one cache dtype to
another. Two workers can exchange blocks exactly when their
``KVLayout`` (kvstore/layout.py, whose namespace prefixes every store key) is
equal, so everything that changes those bytes (or their meaning) goes into it.
"""

from __future__ import annotations

import torch

from kvmesh.kernels import kv_quant
from kvmesh.kvstore.layout import KVLayout
from kvmesh.worker.kv_cache import KVCache

LAYOUT_VERSION = 1


def worker_kv_layout(
    model_name: str,
    dtype: torch.dtype | kv_quant.KVCacheFormat,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: range | None = None,
) -> KVLayout:
    """The layout of this worker's blocks. The model's identity is its name plus
    the cache shape, so two checkpoints that share a name but not a shape never
    exchange blocks. A tensor-parallel rank's blocks hold only its KV heads
    (``tp_rank`` of ``tp_size``, both in the layout, so TP=2 replicas share
    blocks rank by rank and never with TP=1); a pipeline stage's hold only its
    ``layers``, named in the identity. ``dtype``: the cache's, a torch dtype
    (``auto``: the model's) or a quantized format."""
    identity = f"{model_name};layers={num_layers};kv_heads={num_kv_heads};head_dim={head_dim}"
    if layers is not None and len(layers) != num_layers:
        identity += f";stage_layers={layers.start}-{layers.stop}"
    return KVLayout(
        model=identity,
        dtype=(
            dtype.store_name
            if isinstance(dtype, kv_quant.KVCacheFormat)
            else str(dtype).removeprefix("torch.")
        ),
        block_size=block_size,
        layout_version=LAYOUT_VERSION,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class KVBlockCodec:
    """Copies whole blocks between the paged cache and their store bytes.

    Both directions stage all blocks of a call in one ``[n, layers, 2, elems]``
    tensor, so each layer costs one gather (``index_select``) or one scatter
    (``index_copy_``) however many blocks move; a staged row is exactly one
    block's bytes in layout version 1. Blocks move as whole pages
    (``kv_quant.cache_pages``): a quantized cache's codes with their scales.
    """

    def __init__(self, kv_caches: list[KVCache]) -> None:
        self.kv_caches = kv_caches
        # Per layer, [num_blocks, elements of one block's page] views of K and V.
        self._pages = [
            (kv_quant.cache_pages(key_cache), kv_quant.cache_pages(value_cache))
            for key_cache, value_cache in kv_caches
        ]
        first = self._pages[0][0]
        self.num_blocks = first.shape[0]
        self.dtype = first.dtype
        self.device = first.device
        # Elements of one block of K (or V) in one layer.
        self._block_elems = first.shape[1]
        self.block_bytes = len(kv_caches) * 2 * self._block_elems * first.element_size()

    def _staging_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, len(self.kv_caches), 2, self._block_elems)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The bytes of each block, copied out of the cache (a snapshot)."""
        if not block_ids:
            return []
        ids = self._ids(block_ids)
        staged = torch.empty(
            self._staging_shape(len(block_ids)), dtype=self.dtype, device=self.device
        )
        for layer, (flat_keys, flat_values) in enumerate(self._pages):
            torch.index_select(flat_keys, 0, ids, out=staged[:, layer, 0])
            torch.index_select(flat_values, 0, ids, out=staged[:, layer, 1])
        rows = staged.cpu().view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [row.tobytes() for row in rows]

    def write_blocks(self, block_ids: list[int], datas: list[bytes]) -> None:
        """Overwrite each block with its bytes (each exactly ``block_bytes`` long)."""
        if len(datas) != len(block_ids):
            raise ValueError(f"{len(datas)} blocks of bytes for {len(block_ids)} block ids")
        if not block_ids:
            return
        joined = bytearray(len(block_ids) * self.block_bytes)
        view = memoryview(joined)
        for index, data in enumerate(datas):
            if len(data) != self.block_bytes:
                raise ValueError(f"block of {len(data)} bytes, expected {self.block_bytes}")
            view[index * self.block_bytes : (index + 1) * self.block_bytes] = data
        staged = (
            torch.frombuffer(joined, dtype=torch.uint8)
            .view(self.dtype)
            .view(self._staging_shape(len(block_ids)))
            .to(self.device)
        )
        ids = self._ids(block_ids)
        for layer, (flat_keys, flat_values) in enumerate(self._pages):
            flat_keys.index_copy_(0, ids, staged[:, layer, 0])
            flat_values.index_copy_(0, ids, staged[:, layer, 1])
