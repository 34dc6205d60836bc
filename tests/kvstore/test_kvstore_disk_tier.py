"""DiskTier: checksummed records, LRU capacity, corrupt or truncated files never served."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.kvstore.block import RECORD_HEADER_BYTES, StoredBlock, crc32
from kvmesh.kvstore.disk_tier import DiskTier


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def block(i: int, size: int = 100) -> StoredBlock:
    data = bytes([i % 256]) * size
    return StoredBlock(data, crc32(data))


RECORD = RECORD_HEADER_BYTES + 100  # bytes on disk of a 100-byte block


def test_roundtrip_lru_and_capacity(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "blocks", capacity_bytes=3 * RECORD)
    for i in range(3):
        assert disk.put(key(i), block(i))
    assert disk.read(key(0)) == block(0)  # 1 becomes least recently used
    assert disk.put(key(3), block(3))
    assert [disk.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert not disk.put(key(9), block(9, 3 * RECORD))
    stats = disk.stats()
    assert stats.bytes_used == 3 * RECORD and stats.evictions == 1
    assert sum(p.stat().st_size for p in (tmp_path / "blocks").iterdir()) == 3 * RECORD


def test_overwrite_replaces_without_double_counting(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    disk.put(key(1), block(1))
    disk.put(key(1), block(1))
    assert disk.stats().bytes_used == RECORD and len(list(tmp_path.iterdir())) == 1


def test_clears_stale_block_files_only(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    first.put(key(1), block(1))
    (tmp_path / "notes.txt").write_text("keep me")
    second = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    assert not second.contains(key(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    disk.put(key(1), block(1))
    next(tmp_path.glob("*.blk")).unlink()
    assert disk.read(key(1)) is None
    assert disk.stats().bytes_used == 0 and not disk.contains(key(1))


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: RECORD_HEADER_BYTES + 50],  # truncated data
        lambda raw: raw[:7],  # truncated header
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one flipped bit
        lambda raw: b"XXXX" + raw[4:],  # not a record
        lambda raw: raw + b"extra",  # trailing garbage
    ],
)
def test_corrupt_file_is_dropped_and_counted_never_served(tmp_path: Path, damage) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    disk.put(key(1), block(1))
    path = next(tmp_path.glob("*.blk"))
    path.write_bytes(damage(path.read_bytes()))
    assert disk.read(key(1)) is None
    assert not path.exists() and not disk.contains(key(1))
    stats = disk.stats()
    assert stats.corrupt_blocks == 1 and stats.bytes_used == 0


def test_failed_write_leaves_nothing_visible(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=10 * RECORD)
    (tmp_path / f"{key(1).hex()}.blk").mkdir()  # the rename onto it fails, even for root
    assert not disk.put(key(1), block(1))
    stats = disk.stats()
    assert not disk.contains(key(1)) and stats.bytes_used == 0 and stats.write_errors == 1
    assert not list(tmp_path.glob("*.tmp"))
