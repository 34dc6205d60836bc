"""The gRPC service and its client over a real grpc.aio server, per tier configuration.

Two-phase puts end to end: committed blocks round-trip (multi-chunk ones
too), while a put whose stream is cancelled, disconnected, ended early or
fails its CRC-32 leaves nothing in any tier.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from kvmesh.kvstore.block import CHUNK_BYTES, PutOutcome
from kvmesh.kvstore.client import KVStoreClient, KVStoreError
from kvmesh.kvstore.disk_spill import DiskSpillTier
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.shared_fs_tier import SharedFsTier
from kvmesh.kvstore.testing import serve_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import kvstore_pb2, kvstore_pb2_grpc

LAYOUT = KVLayout(model="m", dtype="bfloat16", block_size=16, layout_version=1)


class Served:
    def __init__(self, store: TieredStore, address: str, client: KVStoreClient) -> None:
        self.store = store
        self.address = address
        self.client = client

    async def copies(self, block_hash: bytes) -> list[str]:
        """Tiers holding a copy of the block, after pending spills and writes."""
        await self.store.flush()
        key = LAYOUT.block_key(block_hash)
        return [tier.name for tier in self.store.tiers if (await tier.contains_many([key]))[0]]


def _make_store(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> TieredStore:
    memory = 16 << 20
    if tier == "memory":
        return TieredStore(memory)
    if tier == "disk":
        return TieredStore(memory, [DiskSpillTier(DiskTier(tmp_path, 64 << 20))])
    if tier == "shared_fs":
        return TieredStore(memory, [SharedFsTier.from_path(tmp_path, 64 << 20)])
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e .)")
    from kvmesh.kvstore.redis_tier import RedisTier

    return TieredStore(memory, [RedisTier.from_url(request.getfixturevalue("redis_url"))])


@pytest_asyncio.fixture(loop_scope="function", params=["memory", "disk", "shared_fs", "redis"])
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    store = _make_store(request.param, tmp_path, request)
    async with serve_store(store) as address, KVStoreClient(address, timeout_s=10) as client:
        yield Served(store, address, client)
    await store.close()


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


async def test_put_then_get_roundtrip_including_multi_chunk_blocks(served: Served) -> None:
    sizes = [0, 1, 64 << 10, CHUNK_BYTES, 3 * CHUNK_BYTES + 7]
    blocks = [(h(i), os.urandom(size)) for i, size in enumerate(sizes)]
    assert await served.client.put_blocks(LAYOUT, blocks) == [PutOutcome.STORED] * len(sizes)
    hashes = [block_hash for block_hash, _ in blocks]
    assert await served.client.lookup_prefix([LAYOUT], [*hashes, h(99), h(0)]) == len(sizes)
    result = await served.client.get_blocks(LAYOUT, [h(99), *hashes])
    assert result.blocks == [None] + [payload for _, payload in blocks]
    assert result.lease is None
    again = await served.client.put_blocks(LAYOUT, blocks[:1])
    assert again == [PutOutcome.ALREADY_STORED]


async def test_blocks_of_another_layout_are_never_served(served: Served) -> None:
    await served.client.put_blocks(LAYOUT, [(h(1), b"rank0")])
    rank1 = KVLayout("m", "bfloat16", 16, 1, tp_rank=1, tp_size=2)
    for other in (rank1, KVLayout("m", "float16", 16, 1), KVLayout("m", "bfloat16", 16, 2)):
        assert await served.client.lookup_prefix([other], [h(1)]) == 0
        assert (await served.client.get_blocks(other, [h(1)])).blocks == [None]
    assert await served.client.lookup_prefix([LAYOUT, rank1], [h(1)]) == 0  # rank 1 lacks it


async def test_disconnect_mid_put_leaves_nothing(served: Served) -> None:
    hold = asyncio.Event()

    async def half_a_block() -> AsyncIterator[kvstore_pb2.PutChunk]:
        yield kvstore_pb2.PutChunk(
            layout=LAYOUT.to_proto(),
            begin=kvstore_pb2.PutBegin(block_hash=h(7), size=2 * CHUNK_BYTES),
            data=b"x" * CHUNK_BYTES,
        )
        await hold.wait()  # the client "dies" before sending the rest

    channel = grpc.aio.insecure_channel(served.address)
    call = kvstore_pb2_grpc.KVStoreStub(channel).PutBlocks(half_a_block())
    await eventually(lambda: served.store.stats().inflight_puts == 1)
    assert served.store.memory.stats().bytes_used == 2 * CHUNK_BYTES  # reserved
    await channel.close()  # drops the connection mid-block
    with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
        await call
    await eventually(lambda: served.store.stats().inflight_puts == 0)
    assert served.store.memory.stats().bytes_used == 0
    assert served.store.stats().failed_puts == {"aborted": 1}
    assert await served.client.lookup_prefix([LAYOUT], [h(7)]) == 0
    assert (await served.client.get_blocks(LAYOUT, [h(7)])).blocks == [None]
    assert await served.copies(h(7)) == []


async def test_stream_ending_before_commit_keeps_only_committed_blocks(served: Served) -> None:
    messages = [
        kvstore_pb2.PutChunk(
            layout=LAYOUT.to_proto(),
            begin=kvstore_pb2.PutBegin(block_hash=h(1), size=3),
            data=b"abc",
            commit=kvstore_pb2.PutCommit(crc32=0x352441C2),  # zlib.crc32(b"abc")
        ),
        kvstore_pb2.PutChunk(begin=kvstore_pb2.PutBegin(block_hash=h(2), size=3), data=b"de"),
    ]
    async with grpc.aio.insecure_channel(served.address) as channel:
        reply = await kvstore_pb2_grpc.KVStoreStub(channel).PutBlocks(iter(messages))
    assert list(reply.outcomes) == [kvstore_pb2.PUT_OUTCOME_STORED]
    assert await served.copies(h(1)) != [] and await served.copies(h(2)) == []
    assert await served.client.lookup_prefix([LAYOUT], [h(1), h(2)]) == 1


async def test_wrong_checksum_is_rejected_at_commit(served: Served) -> None:
    message = kvstore_pb2.PutChunk(
        layout=LAYOUT.to_proto(),
        begin=kvstore_pb2.PutBegin(block_hash=h(3), size=3),
        data=b"abc",
        commit=kvstore_pb2.PutCommit(crc32=12345),
    )
    async with grpc.aio.insecure_channel(served.address) as channel:
        reply = await kvstore_pb2_grpc.KVStoreStub(channel).PutBlocks(iter([message]))
    assert list(reply.outcomes) == [kvstore_pb2.PUT_OUTCOME_CORRUPT]
    assert await served.copies(h(3)) == []
    assert served.store.stats().failed_puts == {"corrupt": 1}


async def test_protocol_violation_fails_the_stream_and_aborts_the_open_block(
    served: Served,
) -> None:
    messages = [
        kvstore_pb2.PutChunk(
            layout=LAYOUT.to_proto(),
            begin=kvstore_pb2.PutBegin(block_hash=h(4), size=2),
            data=b"abc",  # more than declared
        )
    ]
    async with grpc.aio.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await kvstore_pb2_grpc.KVStoreStub(channel).PutBlocks(iter(messages))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await served.copies(h(4)) == []
    assert served.store.stats().inflight_puts == 0


async def test_get_with_lease_pins_and_release_unpins(served: Served) -> None:
    await served.client.put_blocks(LAYOUT, [(h(1), b"one"), (h(2), b"two")])
    result = await served.client.get_blocks(LAYOUT, [h(1), h(5), h(2)], lease_ttl_s=30)
    assert result.blocks == [b"one", None, b"two"]
    assert result.lease is not None and result.lease.leased == (True, False, True)
    assert (await served.client.stats()).num_leases == 1
    assert await served.client.release(result.lease.lease_id)
    assert not await served.client.release(result.lease.lease_id)
    lease = await served.client.lease(LAYOUT, [h(2), h(6)], ttl_s=5)
    assert lease.leased == (True, False)
    assert (await served.client.stats()).num_leases == 1


async def test_delete_drops_blocks(served: Served) -> None:
    await served.client.put_blocks(LAYOUT, [(h(1), b"one")])
    assert await served.client.delete(LAYOUT, [h(1), h(2)]) >= 1
    assert await served.copies(h(1)) == []


async def test_invalid_requests_raise_kvstore_error(served: Served) -> None:
    with pytest.raises(KVStoreError, match="INVALID_ARGUMENT"):
        await served.client.lease(LAYOUT, [h(1)], ttl_s=3600)  # above the max
    with pytest.raises(KVStoreError, match="INVALID_ARGUMENT"):
        await served.client.lookup_prefix([], [h(1)])
    with pytest.raises(KVStoreError, match="INVALID_ARGUMENT"):
        await served.client.get_blocks(LAYOUT, [b""])
