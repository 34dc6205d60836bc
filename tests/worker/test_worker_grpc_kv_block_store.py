"""GrpcKVBlockStore against a real in-process kvstore service."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvstore.server import KVStoreServicer
from kvstore.store import BlockStore
from protos import kvstore_pb2, kvstore_pb2_grpc
from services.grpc_server import GrpcService
from worker.grpc_kv_block_store import GrpcKVBlockStore


@asynccontextmanager
async def _kvstore() -> AsyncIterator[str]:
    """A kvstore service on a free port; yields its address."""
    service = GrpcService("kvstore", [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name])
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(
        KVStoreServicer(BlockStore(1 << 20)), service.server
    )
    port = await service.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await service.stop(grace=0)


def _hashes(count: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(count)]


async def test_blocks_come_back_by_hash_within_their_layout_only() -> None:
    hashes = _hashes(6)
    datas = [bytes([i]) * 100 for i in range(5)]
    async with _kvstore() as address:
        # Tiny batches: every call is split into several RPCs.
        store = GrpcKVBlockStore(address, max_put_bytes=250, max_get_keys=2)
        try:
            assert await store.put_blocks(b"layout-a", hashes[:5], datas) == [True] * 5
            assert await store.get_blocks(b"layout-a", hashes[4::-1]) == datas[::-1]
            # The same hashes under another layout name other (absent) blocks.
            assert await store.get_blocks(b"layout-b", hashes[:2]) == [None, None]
            partial = await store.get_blocks(b"layout-a", [hashes[0], hashes[5], hashes[1]])
            assert partial == [datas[0], None, datas[1]]
        finally:
            await store.close()


async def test_an_unreachable_store_raises_for_the_connector_to_count() -> None:
    store = GrpcKVBlockStore("127.0.0.1:1")
    try:
        with pytest.raises(ConnectionError, match="UNAVAILABLE"):
            await store.get_blocks(b"layout", _hashes(1))
        with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1"):
            await store.put_blocks(b"layout", _hashes(1), [b"data"])
    finally:
        await store.close()
