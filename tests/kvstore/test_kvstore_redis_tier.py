"""The Redis tier against a real redis-server: write-through, sharing, corruption, outages."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.block import PutOutcome, StoredBlock, crc32
from kvmesh.kvstore.testing import numbered_key as key
from kvmesh.kvstore.testing import numbered_payload as data
from kvmesh.kvstore.testing import put_block
from kvmesh.kvstore.tiered import TieredStore

pytest.importorskip("redis", reason="redis-py is not installed (pip install -e .)")

from kvmesh.kvstore.redis_tier import KEY_PREFIX, RedisTier


def put(store: TieredStore, i: int, size: int = 100) -> PutOutcome:
    return put_block(store, key(i), data(i, size))


def with_redis(url: str, memory_bytes: int = 1000) -> TieredStore:
    return TieredStore(memory_bytes, [RedisTier.from_url(url)], high_watermark=1, low_watermark=1)


async def raw_redis(url: str):
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url)


async def test_committed_blocks_are_written_through(redis_url: str) -> None:
    store = with_redis(redis_url)
    assert put(store, 1) is PutOutcome.STORED
    await store.flush()
    client = await raw_redis(redis_url)
    record = await client.get(KEY_PREFIX + key(1))
    await client.aclose()
    assert StoredBlock.from_record(record) == StoredBlock(data(1), crc32(data(1)))
    await store.close()


async def test_block_evicted_from_memory_is_served_from_redis(redis_url: str) -> None:
    store = with_redis(redis_url, memory_bytes=200)
    for i in range(3):
        put(store, i)
    await store.flush()
    assert not store.memory.contains(key(0))
    assert await store.lookup_prefix([[key(0), key(1), key(2), key(3)]]) == 3
    blocks, _, _ = await store.get([key(0)])
    assert blocks[0] is not None and blocks[0].data == data(0)
    assert store.memory.contains(key(0))  # promoted
    assert {t.tier: t.hits for t in store.stats().tiers}["redis"] == 1
    await store.close()


async def test_two_stores_share_blocks_through_redis(redis_url: str) -> None:
    writer, reader = with_redis(redis_url), with_redis(redis_url)
    put(writer, 5)
    await writer.flush()
    assert await reader.lookup_prefix([[key(5)]]) == 1
    blocks, _, _ = await reader.get([key(5)])
    assert blocks[0] is not None and blocks[0].data == data(5)
    await writer.close()
    await reader.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda record: record[:-10],  # truncated
        lambda record: record[:-1] + bytes([record[-1] ^ 0x80]),  # flipped bit
        lambda record: record[:5],  # torn header
    ],
)
async def test_corrupt_redis_value_is_dropped_and_counted_never_served(
    redis_url: str, damage
) -> None:
    store = with_redis(redis_url, memory_bytes=200)
    for i in range(3):
        put(store, i)
    await store.flush()
    client = await raw_redis(redis_url)
    redis_key = KEY_PREFIX + key(0)
    await client.set(redis_key, damage(await client.get(redis_key)))
    blocks, _, _ = await store.get([key(0)])
    assert blocks == [None]
    assert await client.exists(redis_key) == 0
    await client.aclose()
    stats = store.stats()
    assert {t.tier: t.corrupt_blocks for t in stats.tiers}["redis"] == 1 and stats.misses == 1
    await store.close()


async def test_redis_down_is_a_miss_not_an_error(redis_url: str) -> None:
    dead_url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    redis = RedisTier.from_url(dead_url, timeout_s=0.5)
    store = TieredStore(200, [redis])
    assert put(store, 1) is PutOutcome.STORED  # memory still works
    assert await store.lookup_prefix([[key(1), key(2)]]) == 1
    blocks, _, _ = await store.get([key(2)])
    assert blocks == [None]
    await store.flush()
    assert redis.stats().errors >= 2
    await store.close()


async def test_delete_and_stats_reach_redis(redis_url: str) -> None:
    store = with_redis(redis_url)
    for i in range(3):
        put(store, i)
    await store.flush()
    await store.refresh()
    assert {t.tier: t.num_blocks for t in store.stats().tiers}["redis"] == 3
    assert await store.delete([key(0)]) == 2  # memory + redis
    await store.refresh()
    assert {t.tier: t.num_blocks for t in store.stats().tiers}["redis"] == 2
    await store.close()


async def test_lease_promotes_from_redis_and_pins_until_expiry(redis_url: str, clock) -> None:
    store = TieredStore(
        200, [RedisTier.from_url(redis_url)], high_watermark=1, low_watermark=1, clock=clock
    )
    for i in range(3):
        put(store, i)
    await store.flush()
    lease_id, leased = await store.lease([key(0), key(9)], ttl_s=10)
    assert leased == [True, False] and store.memory.contains(key(0))
    put(store, 3)
    put(store, 4)
    assert store.memory.contains(key(0))  # pinned: 1..3 were evicted around it
    clock.now += 10  # expired: 0 is evictable again (as the most recently used)
    put(store, 5)
    put(store, 6)
    assert not store.memory.contains(key(0)) and not store.release(lease_id)
    await store.close()


async def test_redis_side_eviction_reads_as_a_clean_miss(redis_url: str) -> None:
    """Redis bounds itself (maxmemory + allkeys-lru); blocks it drops are misses."""
    client = await raw_redis(redis_url)
    await client.config_set("maxmemory", str(4 << 20))
    await client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        store = with_redis(redis_url, memory_bytes=1 << 20)
        for i in range(40):  # 40 x 256 KiB = 10 MiB through a 4 MiB Redis
            put(store, i, size=256 << 10)
            await store.flush()
        assert await client.dbsize() < 40
        keys = [key(i) for i in range(40)]
        prefix = await store.lookup_prefix([keys])
        blocks, _, _ = await store.get(keys)
        assert prefix < 40 and blocks[prefix] is None
        assert all(b is None or b.data == data(i, 256 << 10) for i, b in enumerate(blocks))
        assert blocks[-1] is not None  # the most recent block is in memory
        await store.close()
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()
