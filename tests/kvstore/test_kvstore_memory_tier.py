"""MemoryTier: two-phase puts, watermark eviction, leases (with a fake clock), stats."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.block import PutOutcome, StoredBlock, crc32
from kvmesh.kvstore.memory_tier import MemoryTier
from kvmesh.kvstore.testing import FakeClock, put_block
from kvmesh.kvstore.testing import numbered_key as key
from kvmesh.kvstore.testing import numbered_payload as data
from kvmesh.services.contracts.errors import InvalidRequestError


def put(store: MemoryTier, i: int, size: int = 100) -> PutOutcome:
    return put_block(store, key(i), data(i, size))


def present(tier: MemoryTier, n: int) -> list[bool]:
    return [tier.contains(key(i)) for i in range(n)]


def test_put_is_invisible_until_committed() -> None:
    tier = MemoryTier(1000)
    pending = tier.begin_put(key(1), 100)
    assert pending is not None
    pending.write(data(1))
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert tier.lease([key(1)], 10)[1] == [False]
    assert tier.stats().bytes_used == 100  # reserved from begin on
    assert tier.commit_put(pending, crc32(data(1))) is PutOutcome.STORED
    assert tier.get(key(1)) == StoredBlock(data(1), crc32(data(1)))
    stats = tier.stats()
    assert (stats.num_blocks, stats.bytes_used, stats.inflight_puts) == (1, 100, 0)
    tier.check_integrity()


def test_abort_leaves_nothing() -> None:
    tier = MemoryTier(1000)
    pending = tier.begin_put(key(1), 100)
    assert pending is not None
    pending.write(data(1, 60))
    tier.abort_put(pending)
    tier.abort_put(pending)  # idempotent
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.num_blocks, stats.bytes_used, stats.inflight_puts) == (0, 0, 0)
    tier.check_integrity()


@pytest.mark.parametrize(
    ("written", "checksum"),
    [
        (data(1, 60), crc32(data(1))),  # truncated: 60 of 100 bytes
        (data(1, 60), crc32(data(1, 60))),  # truncated, the CRC-32 of what arrived
        (data(1), crc32(data(2))),  # wrong CRC-32
        (data(1)[:-1] + b"\xff", crc32(data(1))),  # a flipped byte
    ],
)
def test_corrupt_or_truncated_put_is_rejected(written: bytes, checksum: int) -> None:
    tier = MemoryTier(1000)
    pending = tier.begin_put(key(1), 100)
    assert pending is not None
    pending.write(written)
    assert tier.commit_put(pending, checksum) is PutOutcome.CORRUPT
    assert not tier.contains(key(1)) and tier.stats().bytes_used == 0
    tier.check_integrity()


def test_writing_past_the_declared_size_is_refused() -> None:
    tier = MemoryTier(1000)
    pending = tier.begin_put(key(1), 10)
    assert pending is not None
    with pytest.raises(InvalidRequestError):
        pending.write(b"x" * 11)


def test_duplicate_put_keeps_the_stored_block_and_reserves_nothing() -> None:
    tier = MemoryTier(1000)
    assert put(tier, 1) is PutOutcome.STORED
    pending = tier.begin_put(key(1), 100)
    assert pending is not None and pending.reserved == 0
    assert tier.stats().bytes_used == 100
    pending.write(data(1))
    assert tier.commit_put(pending, crc32(data(1))) is PutOutcome.ALREADY_STORED
    assert tier.stats().num_blocks == 1
    tier.check_integrity()


def recording_evictions(capacity: int, high: float, low: float) -> tuple[MemoryTier, list[bytes]]:
    """A tier and the list its evicted keys are appended to."""
    evicted: list[bytes] = []
    tier = MemoryTier(
        capacity, high_watermark=high, low_watermark=low, on_evict=lambda k, _: evicted.append(k)
    )
    return tier, evicted


def test_eviction_starts_past_high_watermark_and_stops_at_low() -> None:
    tier, evicted = recording_evictions(1000, high=0.9, low=0.5)
    for i in range(9):
        assert put(tier, i) is PutOutcome.STORED
    assert evicted == [] and tier.stats().bytes_used == 900  # at the high watermark
    assert put(tier, 9) is PutOutcome.STORED  # 1000 > 900: evict down to <= 500 with it
    assert evicted == [key(i) for i in range(5)]
    assert tier.stats().bytes_used == 500
    assert tier.stats().evictions == 5
    tier.check_integrity()


def test_lru_order_follows_gets_not_contains() -> None:
    tier, evicted = recording_evictions(300, high=1, low=1)
    for i in range(3):
        put(tier, i)
    tier.get(key(0))
    tier.contains(key(1))
    put(tier, 3)
    assert evicted == [key(1)]


def test_eviction_skips_leased_and_inflight_blocks(clock: FakeClock) -> None:
    tier = MemoryTier(400, high_watermark=1, low_watermark=1, clock=clock)
    put(tier, 0)
    put(tier, 1)
    tier.lease([key(0)], ttl_s=30)
    inflight = tier.begin_put(key(2), 100)
    assert inflight is not None
    assert put(tier, 3) is PutOutcome.STORED  # fits: 400 used
    assert put(tier, 4) is PutOutcome.STORED  # evicts 1, the only unpinned committed block
    assert present(tier, 5) == [True, False, False, True, True]
    assert put(tier, 5, size=200) is PutOutcome.STORED  # evicts 3 and 4
    # Now 0 is leased, 2 in flight, 5 fresh: 400 bytes, nothing evictable but 5.
    assert put(tier, 6, size=300) is PutOutcome.NO_ROOM
    assert tier.contains(key(0)) and tier.stats().rejected_puts == 1
    inflight.write(data(2))
    assert tier.commit_put(inflight, crc32(data(2))) is PutOutcome.STORED
    tier.check_integrity()


def test_block_larger_than_capacity_is_refused_without_evicting() -> None:
    tier = MemoryTier(250)
    put(tier, 0)
    assert tier.begin_put(key(1), 251) is None
    assert tier.contains(key(0)) and tier.stats().evictions == 0


def test_lease_expires_after_ttl(clock: FakeClock) -> None:
    tier = MemoryTier(200, high_watermark=1, low_watermark=1, clock=clock)
    put(tier, 0)
    put(tier, 1)
    lease_id, leased = tier.lease([key(0), key(1), key(9)], ttl_s=10)
    assert leased == [True, True, False]
    clock.now += 9.9
    assert put(tier, 2) is PutOutcome.NO_ROOM
    assert tier.stats().num_leases == 1
    clock.now += 0.2
    assert put(tier, 2) is PutOutcome.STORED
    assert tier.stats().num_leases == 0 and not tier.release(lease_id)
    tier.check_integrity()


def test_release_unpins_and_overlapping_leases_pin_until_the_last(clock: FakeClock) -> None:
    tier = MemoryTier(100, high_watermark=1, low_watermark=1, clock=clock)
    put(tier, 0)
    first, _ = tier.lease([key(0)], ttl_s=5)
    second, _ = tier.lease([key(0)], ttl_s=20)
    assert tier.release(first) and not tier.release(first)
    assert put(tier, 1) is PutOutcome.NO_ROOM
    assert tier.release(second)
    assert put(tier, 1) is PutOutcome.STORED
    tier.check_integrity()


def test_leased_block_survives_delete(clock: FakeClock) -> None:
    tier = MemoryTier(300, clock=clock)
    put(tier, 0)
    lease_id, _ = tier.lease([key(0)], ttl_s=5)
    assert tier.delete([key(0)]) == 0
    assert tier.get(key(0)) is not None
    tier.release(lease_id)
    assert tier.delete([key(0)]) == 1
    tier.check_integrity()


def test_lease_rejects_non_positive_ttl() -> None:
    with pytest.raises(ValueError):
        MemoryTier(100).lease([key(0)], ttl_s=0)


def test_invalid_watermarks_are_rejected() -> None:
    with pytest.raises(ValueError):
        MemoryTier(100, high_watermark=0.5, low_watermark=0.8)
