"""The shared-filesystem tier: kvstores sharing one directory, atomic checksummed files,
a byte bound kept by LRU sweeps that may run concurrently, refusals at start-up."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.kvstore import shared_fs_files
from kvmesh.kvstore.block import RECORD_HEADER_BYTES, PutOutcome, StoredBlock, crc32
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.metrics import StoreCollector
from kvmesh.kvstore.server import build_store
from kvmesh.kvstore.shared_fs_files import VERSION_DIR, SharedFsFiles, SharedFsUnusable
from kvmesh.kvstore.shared_fs_tier import SharedFsTier
from kvmesh.kvstore.testing import FakeClock, put_block, serve_store
from kvmesh.kvstore.testing import numbered_payload as data
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.services.runtime.config import KVStoreConfig

LAYOUT = KVLayout(model="m", dtype="float32", block_size=16, layout_version=1)
OTHER_MODEL = KVLayout(model="other", dtype="float32", block_size=16, layout_version=1)
RECORD = RECORD_HEADER_BYTES + 100  # bytes on the volume of a 100-byte block


def key(i: int, layout: KVLayout = LAYOUT) -> bytes:
    return layout.block_key(i.to_bytes(8, "little"))


def block(i: int) -> StoredBlock:
    return StoredBlock(data(i), crc32(data(i)))


def tier(root: Path, capacity: int = 100 * RECORD, **kwargs) -> SharedFsTier:
    # touch_after_s=0: every hit re-touches, so tests see recency at once.
    return SharedFsTier(SharedFsFiles(root), capacity, touch_after_s=0, **kwargs)


def store(root: Path, memory_bytes: int = 1000, **kwargs) -> TieredStore:
    return TieredStore(memory_bytes, [tier(root, **kwargs)], high_watermark=1, low_watermark=1)


def block_files(root: Path) -> list[Path]:
    return sorted((root / VERSION_DIR).glob("*/*/*.blk"))


def age(files: SharedFsFiles, i: int, seconds_ago: float) -> None:
    """Set block i's mtime (the tier's recency) ``seconds_ago`` into the past."""
    when = os.stat(files.path(key(i))).st_mtime - seconds_ago
    os.utime(files.path(key(i)), (when, when))


async def test_two_stores_share_one_directory(tmp_path: Path) -> None:
    writer, reader = store(tmp_path), store(tmp_path)
    assert put_block(writer, key(5), data(5)) is PutOutcome.STORED
    await writer.flush()
    assert await reader.lookup_prefix([[key(5), key(6)]]) == 1
    blocks, _, _ = await reader.get([key(5)])
    assert blocks[0] == block(5)
    assert reader.memory.contains(key(5))  # promoted: the next read is a memory hit
    assert {t.tier: t.hits for t in reader.stats().tiers} == {"memory": 0, "shared_fs": 1}
    await writer.close()
    await reader.close()


async def test_file_layout_and_layout_isolation(tmp_path: Path) -> None:
    shared = store(tmp_path)
    put_block(shared, key(1), data(1))
    await shared.flush()
    block_hash = (1).to_bytes(8, "little")
    path = tmp_path / VERSION_DIR / LAYOUT.namespace.hex() / "01" / f"{block_hash.hex()}.blk"
    assert block_files(tmp_path) == [path]
    assert StoredBlock.from_record(path.read_bytes()) == block(1)
    # The same block hash under another model is another file, never this one.
    other = store(tmp_path)
    assert await other.lookup_prefix([[key(1, OTHER_MODEL)]]) == 0
    assert (await other.get([key(1, OTHER_MODEL)]))[0] == [None]
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob(".probe*"))
    await shared.close()
    await other.close()


async def test_block_is_served_while_its_write_is_under_way(tmp_path: Path) -> None:
    shared = tier(tmp_path)
    shared.write_through(key(1), block(1))  # the write task has not run yet
    assert await shared.contains_many([key(1)]) == [True]
    assert await shared.get_many([key(1)]) == [block(1)]
    await shared.flush()
    assert shared.stats().writes == 1
    shared.write_through(key(1), block(1))  # another replica's copy is already there
    await shared.flush()
    assert shared.stats().already_present == 1 and len(block_files(tmp_path)) == 1
    await shared.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: RECORD_HEADER_BYTES + 50],  # truncated data
        lambda raw: raw[:7],  # torn header
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one flipped bit
        lambda raw: b"XXXX" + raw[4:],  # not a record
    ],
)
async def test_corrupt_file_is_dropped_and_counted_never_served(tmp_path: Path, damage) -> None:
    writer, reader = store(tmp_path), store(tmp_path)
    put_block(writer, key(1), data(1))
    await writer.flush()
    (path,) = block_files(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    blocks, _, _ = await reader.get([key(1)])
    assert blocks == [None] and not path.exists()
    stats = reader.stats()
    assert {t.tier: t.corrupt_blocks for t in stats.tiers}["shared_fs"] == 1 and stats.misses == 1
    registry = CollectorRegistry()
    registry.register(StoreCollector(stats))
    corrupt = registry.get_sample_value(
        "kvmesh:kvstore_corrupt_blocks_total", {"source": "shared_fs"}
    )
    assert corrupt == 1
    await writer.close()
    await reader.close()


async def test_file_vanishing_after_lookup_is_a_miss_not_an_error(tmp_path: Path) -> None:
    shared = tier(tmp_path)
    shared.write_through(key(1), block(1))
    await shared.flush()
    assert await shared.contains_many([key(1), key(2)]) == [True, False]
    block_files(tmp_path)[0].unlink()  # another kvstore's sweep
    assert await shared.get_many([key(1)]) == [None]
    assert shared.stats().read_errors == 0 and await shared.delete_many([key(1)]) == 0
    await shared.close()


async def test_failed_write_leaves_nothing_visible(tmp_path: Path) -> None:
    shared = tier(tmp_path)
    shared.files.path(key(1)).mkdir(parents=True)  # the rename onto it fails, even for root
    shared.write_through(key(1), block(1))
    await shared.flush()
    assert shared.stats().write_errors == 1
    assert await shared.get_many([key(1)]) == [None]
    assert not list(tmp_path.rglob("*.tmp"))
    await shared.close()


async def test_sweep_evicts_least_recently_used_down_to_the_low_mark(tmp_path: Path) -> None:
    shared = tier(tmp_path, capacity=6 * RECORD, low_watermark=0.5)
    for i in range(6):
        shared.write_through(key(i), block(i))
    await shared.flush()
    for i in range(6):
        age(shared.files, i, seconds_ago=600 - 10 * i)  # 0 oldest ... 5 newest
    assert await shared.get_many([key(0)]) == [block(0)]  # a hit: 0 is the newest now
    await shared.sweep()  # learns the volume holds 6 records: at its bound, not past it
    assert shared.stats().evictions == 0
    shared.write_through(key(6), block(6))  # 7 records > 6: the write starts a sweep
    await shared.flush()
    await shared.sweep()  # joins it, or finds nothing more to do
    assert [shared.files.exists(key(i)) for i in range(7)] == [True] + [False] * 4 + [True] * 2
    stats = {t.tier: t for t in TieredStore(1, [shared]).stats().tiers}["shared_fs"]
    assert (stats.num_blocks, stats.bytes_used, stats.evictions) == (3, 3 * RECORD, 4)
    assert stats.capacity_bytes == 6 * RECORD
    await shared.close()


async def test_periodic_sweep_sees_other_kvstores_writes(tmp_path: Path) -> None:
    clock = FakeClock()
    writer, watcher = tier(tmp_path), tier(tmp_path, sweep_interval_s=30, clock=clock)
    await watcher.refresh()  # the first refresh lists the volume
    await watcher.sweep()
    for i in range(3):
        writer.write_through(key(i), block(i))
    await writer.flush()
    await watcher.refresh()  # too soon: no new listing
    assert watcher.stats().num_blocks == 0 and watcher.stats().sweeps == 1
    clock.now += 30
    await watcher.refresh()
    await watcher.sweep()  # joins the sweep refresh started
    assert watcher.stats().num_blocks == 3 and watcher.stats().bytes_used == 3 * RECORD
    await writer.close()
    await watcher.close()


def test_stale_temporary_files_of_dead_writers_are_swept(tmp_path: Path) -> None:
    files = SharedFsFiles(tmp_path)
    files.write(key(1), block(1))
    directory = files.path(key(1)).parent
    dead, live = directory / ".x.host.1.0.tmp", directory / ".y.host.2.0.tmp"
    dead.write_bytes(b"half a record")
    live.write_bytes(b"being written")
    old = dead.stat().st_mtime - shared_fs_files.STALE_TMP_S - 1
    os.utime(dead, (old, old))
    result = files.sweep(capacity_bytes=10 * RECORD, low_bytes=5 * RECORD)
    assert result.stale_tmp_removed == 1 and not dead.exists() and live.exists()
    assert result.num_blocks == 1 and result.bytes_used == RECORD + len(b"being written")
    files.delete(key(1))  # over the bound with nothing but a write under way: nothing to do
    assert files.sweep(capacity_bytes=1, low_bytes=1).num_blocks == 0 and live.exists()


def test_concurrent_evictors_share_the_work_without_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's listing is taken, then B sweeps the whole volume, then A evicts from its listing:
    files B removed are skipped, not errors, and each eviction is counted once."""
    a, b = SharedFsFiles(tmp_path), SharedFsFiles(tmp_path)
    for i in range(10):
        a.write(key(i), block(i))
        age(a, i, seconds_ago=1000 - 10 * i)
    original = shared_fs_files._lru_cutoff
    b_result = []

    def b_sweeps_between_a_listing_and_a_eviction(*args):
        if not b_result:  # A's cutoff (B's own sweep comes through here too)
            b_result.append(None)
            b_result[0] = b.sweep(capacity_bytes=8 * RECORD, low_bytes=6 * RECORD)
        return original(*args)

    monkeypatch.setattr(shared_fs_files, "_lru_cutoff", b_sweeps_between_a_listing_and_a_eviction)
    a_result = a.sweep(capacity_bytes=8 * RECORD, low_bytes=5 * RECORD)
    survivors = [i for i in range(10) if a.exists(key(i))]
    assert survivors == [5, 6, 7, 8, 9]  # the newest, whoever evicted
    assert b_result[0].evicted + a_result.evicted == 5
    assert (a_result.num_blocks, a_result.bytes_used) == (5, 5 * RECORD)


def test_files_vanishing_between_listing_and_stat_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = SharedFsFiles(tmp_path)
    for i in range(8):
        files.write(key(i), block(i))
        age(files, i, seconds_ago=100 - i)
    original = shared_fs_files._scan

    def another_sweeper_removes_one(path: str) -> list[os.DirEntry[str]]:
        entries = original(path)
        for entry in entries:
            if entry.name.endswith(".blk"):
                os.unlink(entry.path)  # listed, but gone before its stat
                break
        return entries

    monkeypatch.setattr(shared_fs_files, "_scan", another_sweeper_removes_one)
    result = files.sweep(capacity_bytes=2 * RECORD, low_bytes=2 * RECORD)
    monkeypatch.undo()
    left = block_files(tmp_path)
    assert (result.num_blocks, result.bytes_used) == (len(left), len(left) * RECORD)
    assert len(left) <= 2


def test_concurrent_evictors_on_threads(tmp_path: Path) -> None:
    sweepers = [SharedFsFiles(tmp_path) for _ in range(4)]
    for i in range(40):
        sweepers[0].write(key(i), block(i))
        age(sweepers[0], i, seconds_ago=1000 - i)
    start = threading.Barrier(len(sweepers))
    results = []

    def sweep(files: SharedFsFiles) -> None:
        start.wait()
        results.append(files.sweep(capacity_bytes=20 * RECORD, low_bytes=20 * RECORD))

    threads = [threading.Thread(target=sweep, args=(files,)) for files in sweepers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    survivors = [i for i in range(40) if sweepers[0].exists(key(i))]
    assert len(results) == 4 and sum(r.evicted for r in results) == 40 - len(survivors)
    assert survivors == list(range(40 - len(survivors), 40)) and 0 < len(survivors) <= 20


def test_start_up_refuses_an_unusable_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SharedFsUnusable, match="mount the shared volume there first"):
        SharedFsFiles(tmp_path / "not-mounted")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SharedFsUnusable, match="not a directory"):
        SharedFsFiles(tmp_path / "a-file")

    # A volume that refuses the probe's rename: refused now, not once per block.
    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(shared_fs_files.os, "replace", refuse)
    with pytest.raises(SharedFsUnusable, match=r"not writable by uid .*Permission denied"):
        SharedFsFiles(tmp_path)
    monkeypatch.undo()
    assert not [p for p in (tmp_path / VERSION_DIR).iterdir()]  # no probe left behind
    config = KVStoreConfig(kvstore_shared_fs_path=str(tmp_path / "not-mounted"))
    with pytest.raises(ValueError, match=r"--kvstore-shared-fs-path: .* not a directory"):
        build_store(config)


@pytest.mark.parametrize("disk", ["shared", "shared/disk", "."])
def test_config_refuses_a_disk_tier_overlapping_the_shared_directory(
    tmp_path: Path, disk: str
) -> None:
    with pytest.raises(ValueError, match="must not overlap"):
        KVStoreConfig(
            kvstore_disk_path=str(tmp_path / disk),
            kvstore_shared_fs_path=str(tmp_path / "shared"),
        )
    with pytest.raises(ValueError):
        KVStoreConfig(kvstore_shared_fs_path=str(tmp_path), kvstore_shared_fs_bytes=0)


async def test_two_kvstore_services_share_blocks_through_the_directory(tmp_path: Path) -> None:
    """As deployed: two kvstores built from their flags, over gRPC; one replica's worker
    saves a prefix to its kvstore, another replica's scheduler finds it in the other."""
    config = KVStoreConfig(kvstore_shared_fs_path=str(tmp_path))
    first, second = build_store(config), build_store(config)
    hashes = [bytes([i]) * 32 for i in range(3)]
    payloads = [os.urandom(3000) for _ in hashes]
    async with (
        serve_store(first) as first_address,
        serve_store(second) as second_address,
        KVStoreClient(first_address, timeout_s=10) as saver,
        KVStoreClient(second_address, timeout_s=10) as loader,
    ):
        stored = await saver.put_blocks(LAYOUT, list(zip(hashes, payloads, strict=True)))
        assert stored == [PutOutcome.STORED] * 3
        await first.flush()
        assert await loader.lookup_prefix([LAYOUT], [*hashes, b"x" * 32]) == 3
        assert await loader.lookup_prefix([OTHER_MODEL], hashes) == 0
        assert (await loader.get_blocks(LAYOUT, hashes)).blocks == payloads
    hits = {t.tier: t.hits for t in second.stats().tiers}
    assert hits == {"memory": 0, "shared_fs": 3}
    await first.close()
    await second.close()
