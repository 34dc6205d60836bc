"""KVStoreBlocks: the worker connector's store, over a real in-process kvstore service."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmesh.kvstore.client import KVStoreClient, KVStoreError
from kvmesh.kvstore.testing import serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.worker.kv_layout import worker_kv_layout
from kvmesh.worker.kvstore_blocks import KVStoreBlocks

LAYOUT = worker_kv_layout("m", torch.float32, 16, 2, 1, 4)
OTHER = worker_kv_layout("m", torch.bfloat16, 16, 2, 1, 4)


def _hashes(count: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(count)]


async def test_blocks_come_back_by_hash_within_their_layout_only() -> None:
    hashes = _hashes(6)
    datas = [bytes([i]) * 100 for i in range(5)]
    async with serve_store(TieredStore(1 << 20)) as address:
        client = KVStoreClient(address, chunk_bytes=64)  # every block in several chunks
        store, other = KVStoreBlocks(client, LAYOUT), KVStoreBlocks(client, OTHER)
        try:
            assert await store.put_blocks(hashes[:5], datas) == [True] * 5
            # Putting a block again is as good as storing it.
            assert await store.put_blocks(hashes[:1], datas[:1]) == [True]
            assert await store.get_blocks(hashes[4::-1]) == datas[::-1]
            # The same hashes under another layout name other (absent) blocks.
            assert await other.get_blocks(hashes[:2]) == [None, None]
            partial = await store.get_blocks([hashes[0], hashes[5], hashes[1]])
            assert partial == [datas[0], None, datas[1]]
        finally:
            await store.close()


async def test_an_unreachable_store_raises_for_the_connector_to_count() -> None:
    store = KVStoreBlocks(KVStoreClient("127.0.0.1:1", timeout_s=2.0), LAYOUT)
    try:
        with pytest.raises(KVStoreError):
            await store.get_blocks(_hashes(1))
        with pytest.raises(KVStoreError):
            await store.put_blocks(_hashes(1), [b"data"])
    finally:
        await store.close()
