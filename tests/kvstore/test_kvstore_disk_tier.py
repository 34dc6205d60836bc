"""Disk tier and the memory+disk store: spill on eviction, promote on hit."""

from __future__ import annotations

from pathlib import Path

from kvstore.disk_tier import DiskTier
from kvstore.tiered import TieredBlockStore


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def test_disk_tier_roundtrip_lru_and_capacity(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "blocks", capacity_bytes=300)
    for i in range(3):
        assert disk.put(key(i), block(i))
    assert disk.get(key(0)) == block(0)  # 1 becomes least recently used
    assert disk.put(key(3), block(3))
    assert disk.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert not disk.put(key(9), block(9, 301))
    stats = disk.stats()
    assert stats.bytes_used == 300 and stats.evictions == 1
    assert sum(p.stat().st_size for p in (tmp_path / "blocks").iterdir()) == 300


def test_disk_tier_clears_stale_block_files_only(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, capacity_bytes=1000)
    first.put(key(1), block(1))
    (tmp_path / "notes.txt").write_text("keep me")
    second = DiskTier(tmp_path, capacity_bytes=1000)
    assert second.contains([key(1)]) == [False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=1000)
    disk.put(key(1), block(1))
    next(tmp_path.glob("*.blk")).unlink()
    assert disk.get(key(1)) is None
    assert disk.stats().bytes_used == 0


def test_tiered_store_spills_and_promotes(tmp_path: Path) -> None:
    store = TieredBlockStore(200, DiskTier(tmp_path, capacity_bytes=1000))
    for i in range(4):
        assert store.put(key(i), block(i))
    # Memory holds the two most recent; the two oldest spilled to disk.
    assert store.memory.contains([key(i) for i in range(4)]) == [False, False, True, True]
    assert store.disk.contains([key(0), key(1)]) == [True, True]
    assert store.contains([key(i) for i in range(5)]) == [True] * 4 + [False]
    assert store.get(key(0)) == block(0)
    assert store.memory.contains([key(0)]) == [True]
    assert store.disk.contains([key(0)]) == [False]  # exclusive tiers
    for i in range(4):
        assert store.get(key(i)) == block(i)
    assert store.memory.stats().bytes_used <= 200
    store.memory.check_integrity()


def test_tiered_lease_brings_block_back_and_pins_it(tmp_path: Path) -> None:
    store = TieredBlockStore(200, DiskTier(tmp_path, capacity_bytes=1000))
    for i in range(3):
        store.put(key(i), block(i))
    lease_id = store.lease([key(0)], ttl_s=10)
    for i in range(3, 6):
        store.put(key(i), block(i))
    assert store.memory.contains([key(0)]) == [True]
    assert store.release(lease_id)
    assert store.delete([key(0), key(1)]) == 2
    assert store.contains([key(0), key(1)]) == [False, False]
