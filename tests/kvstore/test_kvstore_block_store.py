"""BlockStore: capacity, LRU eviction, leases, stats."""

from __future__ import annotations

import random

import pytest

from kvstore.store import BlockStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_put_get_roundtrip_and_overwrite() -> None:
    store = BlockStore(1000)
    assert store.get(key(1)) is None
    assert store.put(key(1), block(1))
    assert store.get(key(1)) == block(1)
    assert store.put(key(1), block(2, 300))
    assert store.get(key(1)) == block(2, 300)
    stats = store.stats()
    assert (stats.num_blocks, stats.bytes_used) == (1, 300)
    assert (stats.hits, stats.misses) == (2, 1)
    store.check_integrity()


def test_contains_and_delete() -> None:
    store = BlockStore(1000)
    store.put(key(1), block(1))
    store.put(key(2), block(2))
    assert store.contains([key(1), key(3), key(2)]) == [True, False, True]
    assert store.delete([key(1), key(3)]) == 1
    assert store.contains([key(1), key(2)]) == [False, True]
    assert store.stats().bytes_used == 100
    store.check_integrity()


def test_lru_evicts_least_recently_used_first() -> None:
    evicted: list[bytes] = []
    store = BlockStore(300, on_evict=lambda k, _data: evicted.append(k))
    for i in range(3):
        assert store.put(key(i), block(i))
    store.get(key(0))  # 1 is now the least recently used
    assert store.put(key(3), block(3))
    assert evicted == [key(1)]
    assert store.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert store.put(key(4), block(4, 200))  # needs two blocks: 2 then 0
    assert evicted == [key(1), key(2), key(0)]
    assert store.stats().evictions == 3
    store.check_integrity()


def test_contains_does_not_refresh_recency() -> None:
    store = BlockStore(200)
    store.put(key(0), block(0))
    store.put(key(1), block(1))
    store.contains([key(0)])
    store.put(key(2), block(2))
    assert store.contains([key(0), key(1)]) == [False, True]


def test_oversized_block_refused_and_nothing_evicted() -> None:
    store = BlockStore(250)
    store.put(key(0), block(0))
    assert not store.put(key(1), block(1, 251))
    assert store.get(key(1)) is None
    assert store.contains([key(0)]) == [True]
    stats = store.stats()
    assert stats.rejected_puts == 1 and stats.evictions == 0


def test_overwrite_that_grows_evicts_others_not_itself() -> None:
    store = BlockStore(300)
    for i in range(3):
        store.put(key(i), block(i))
    assert store.put(key(0), block(9, 250))
    assert store.get(key(0)) == block(9, 250)
    assert store.stats().bytes_used <= 300
    store.check_integrity()


def test_lease_blocks_eviction_until_released(clock: FakeClock) -> None:
    store = BlockStore(300, clock=clock)
    for i in range(3):
        store.put(key(i), block(i))
    lease_id = store.lease([key(0), key(1), key(99)], ttl_s=30)
    assert store.put(key(3), block(3))  # only block 2 was evictable
    assert store.contains([key(0), key(1), key(2)]) == [True, True, False]
    # Now everything left is leased or the new block; a 200-byte block cannot fit.
    assert not store.put(key(4), block(4, 200))
    assert store.contains([key(0), key(1), key(3)]) == [True, True, True]
    assert store.release(lease_id)
    assert not store.release(lease_id)
    assert store.put(key(4), block(4, 200))
    assert store.stats().num_leases == 0
    store.check_integrity()


def test_lease_expires_after_ttl(clock: FakeClock) -> None:
    store = BlockStore(200, clock=clock)
    store.put(key(0), block(0))
    store.put(key(1), block(1))
    lease_id = store.lease([key(0), key(1)], ttl_s=10)
    clock.now += 9.9
    assert not store.put(key(2), block(2))
    clock.now += 0.2
    assert store.put(key(2), block(2))
    assert store.stats().num_leases == 0 and not store.release(lease_id)
    store.check_integrity()


def test_overlapping_leases_pin_until_the_last_ends(clock: FakeClock) -> None:
    store = BlockStore(100, clock=clock)
    store.put(key(0), block(0))
    first = store.lease([key(0)], ttl_s=5)
    store.lease([key(0)], ttl_s=20)
    store.release(first)
    assert not store.put(key(1), block(1))
    clock.now += 21
    assert store.put(key(1), block(1))
    store.check_integrity()


def test_leased_block_survives_delete(clock: FakeClock) -> None:
    store = BlockStore(300, clock=clock)
    store.put(key(0), block(0))
    lease_id = store.lease([key(0)], ttl_s=5)
    assert store.delete([key(0)]) == 0
    assert store.get(key(0)) == block(0)
    store.release(lease_id)
    assert store.delete([key(0)]) == 1


def test_lease_rejects_non_positive_ttl() -> None:
    with pytest.raises(ValueError):
        BlockStore(100).lease([key(0)], ttl_s=0)


def test_random_operations_keep_accounting_exact(clock: FakeClock) -> None:
    rng = random.Random(5)
    capacity = 2_000
    store = BlockStore(capacity, clock=clock)
    contents: dict[bytes, bytes] = {}
    leases: list[int] = []
    for step in range(3_000):
        op = rng.random()
        k = key(rng.randrange(40))
        if op < 0.5:
            data = block(step, rng.randint(1, 600))
            if store.put(k, data):
                contents[k] = data
        elif op < 0.7:
            got = store.get(k)
            assert got is None or got == contents[k]  # never stale bytes
        elif op < 0.8:
            store.delete([k])
        elif op < 0.9:
            leases.append(
                store.lease([key(rng.randrange(40)) for _ in range(3)], rng.uniform(1, 20))
            )
        elif leases:
            store.release(leases.pop(rng.randrange(len(leases))))
        clock.now += rng.uniform(0, 0.5)
        stats = store.stats()
        assert stats.bytes_used <= capacity
        store.check_integrity()
    assert store.stats().evictions > 0 and store.stats().rejected_puts > 0
