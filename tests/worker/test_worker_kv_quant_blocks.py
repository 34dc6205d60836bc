"""Quantized KV blocks in the kvstore: whole pages move, and never across cache dtypes.

A block of an int8 (or fp8) cache is its pages: codes and their per-token-head
scales. Its layout names the format, so a replica with an int8 cache misses
(never decodes) the blocks of a bfloat16/float32 replica for the same prefix
(prefix sharing across replicas, offload, P/D disaggregation), and the other
way round.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from kvmesh.kernels import kv_quant
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.testing import serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.worker.kv_layout import KVBlockCodec, worker_kv_layout
from kvmesh.worker.kvstore_blocks import KVStoreBlocks
from kvmesh.worker.server import runner_kv_layout

SHAPE = (6, 4, 2, 8)  # blocks, block_size, kv_heads, head_dim


def _quantized_caches(fmt: kv_quant.KVCacheFormat, seed: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        pair = []
        for _ in range(2):
            cache = kv_quant.allocate_pages(fmt, *SHAPE)
            codes, scales = kv_quant.quantize(torch.randn(SHAPE, generator=generator), fmt)
            cache.copy_(codes)
            kv_quant.cache_scales(cache).copy_(scales)
            pair.append(cache)
        layers.append(tuple(pair))
    return layers


def _layouts() -> dict[str, object]:
    args = ("m", 16, 30, 3, 64)
    return {
        "float32": worker_kv_layout(args[0], torch.float32, *args[1:]),
        "bfloat16": worker_kv_layout(args[0], torch.bfloat16, *args[1:]),
        **{
            name: worker_kv_layout(args[0], fmt, *args[1:])
            for name, fmt in kv_quant.FORMATS.items()
        },
    }


def test_blocks_are_whole_pages_and_round_trip_exactly() -> None:
    source = _quantized_caches(kv_quant.INT8, seed=1)
    target = _quantized_caches(kv_quant.INT8, seed=2)
    codec = KVBlockCodec(source)
    page = kv_quant.page_bytes(*SHAPE[1:])
    assert codec.block_bytes == 2 * 2 * page  # layers x (K, V) x page
    [data] = codec.read_blocks([3])
    KVBlockCodec(target).write_blocks([5], [data])
    for (sk, sv), (tk, tv) in zip(source, target, strict=True):
        for s, t in ((sk, tk), (sv, tv)):
            assert torch.equal(s[3].view(torch.uint8), t[5].view(torch.uint8))
            assert torch.equal(kv_quant.cache_scales(s)[3], kv_quant.cache_scales(t)[5])
    # Other blocks of the target are untouched.
    assert not torch.equal(source[0][0][4].view(torch.uint8), target[0][0][4].view(torch.uint8))


def test_every_cache_dtype_has_its_own_namespace() -> None:
    layouts = _layouts()
    assert layouts["int8"].dtype == "int8+scale_per_token_head"
    assert len({layout.namespace for layout in layouts.values()}) == len(layouts)
    # The worker names its layout by the cache's format, not the model dtype.
    runner = SimpleNamespace(
        model_config=SimpleNamespace(
            dtype=torch.float32, num_layers=30, num_kv_heads=3, head_dim=64
        ),
        plan=SimpleNamespace(tp_rank=0, tp_size=1, layers=range(30)),
        cache_config=SimpleNamespace(kv_format=kv_quant.INT8),
    )
    info = SimpleNamespace(model_name="m", block_size=16)
    assert runner_kv_layout(runner, info) == layouts["int8"]
    runner.cache_config.kv_format = None
    assert runner_kv_layout(runner, info) == layouts["float32"]


async def test_an_int8_replica_misses_a_float32_replicas_blocks() -> None:
    layouts = _layouts()
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(3)]
    async with serve_store(TieredStore(1 << 20)) as address:
        client = KVStoreClient(address)
        float32 = KVStoreBlocks(client, layouts["float32"])
        int8 = KVStoreBlocks(client, layouts["int8"])
        fp8 = KVStoreBlocks(client, layouts["fp8_e4m3"])
        try:
            assert await float32.put_blocks(hashes, [b"f" * 64] * 3) == [True] * 3
            assert await int8.get_blocks(hashes) == [None] * 3
            assert await int8.put_blocks(hashes[:1], [b"q" * 32]) == [True]
            assert await fp8.get_blocks(hashes) == [None] * 3
            assert await int8.get_blocks(hashes) == [b"q" * 32, None, None]
            assert await float32.get_blocks(hashes[:1]) == [b"f" * 64]
        finally:
            await float32.close()
