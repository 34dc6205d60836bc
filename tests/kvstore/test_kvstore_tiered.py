"""TieredStore over memory + disk (+ the shared filesystem): spill on eviction, promote on
hit, exclusive and shared tiers."""

from __future__ import annotations

from pathlib import Path

from kvmesh.kvstore.block import RECORD_HEADER_BYTES, PutOutcome
from kvmesh.kvstore.disk_spill import DiskSpillTier
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.shared_fs_tier import SharedFsTier
from kvmesh.kvstore.testing import FakeClock, put_block
from kvmesh.kvstore.testing import numbered_key as key
from kvmesh.kvstore.testing import numbered_payload as data
from kvmesh.kvstore.tiered import TieredStore


def put(store: TieredStore, i: int, size: int = 100) -> PutOutcome:
    return put_block(store, key(i), data(i, size))


def tiered(tmp_path: Path, memory_bytes: int = 200, **kwargs) -> TieredStore:
    # Watermarks at 1: evict exactly what a put needs, so tests can count blocks.
    return TieredStore(
        memory_bytes,
        [DiskSpillTier(DiskTier(tmp_path, capacity_bytes=10_000))],
        high_watermark=1,
        low_watermark=1,
        **kwargs,
    )


def where(store: TieredStore, n: int) -> list[str]:
    """The tier holding each of blocks 0..n-1 ("-": none)."""
    disk = store.tier("disk")
    assert isinstance(disk, DiskSpillTier)
    tiers = []
    for i in range(n):
        if store.memory.contains(key(i)):
            tiers.append("memory")
        else:
            tiers.append("disk" if disk.contains(key(i)) else "-")
    return tiers


async def test_evictions_spill_to_disk_and_hits_come_back(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    for i in range(4):
        assert put(store, i) is PutOutcome.STORED
    await store.flush()
    assert where(store, 4) == ["disk", "disk", "memory", "memory"]
    blocks, _, _ = await store.get([key(0), key(9)])
    assert [b.data if b else None for b in blocks] == [data(0), None]
    await store.flush()
    assert where(store, 4) == ["memory", "disk", "disk", "memory"]  # 0 moved up, 2 spilled
    stats = store.stats()
    hits = {t.tier: t.hits for t in stats.tiers}
    assert hits == {"memory": 0, "disk": 1} and stats.misses == 1
    assert store.memory.stats().bytes_used <= 200
    await store.close()


async def test_block_in_transit_to_disk_is_still_found(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    for i in range(3):
        put(store, i)
    # Block 0 was evicted just now; its disk write may not have run yet.
    assert await store.lookup_prefix([[key(0), key(1), key(2)]]) == 3
    blocks, _, _ = await store.get([key(0)])
    assert blocks[0] is not None and blocks[0].data == data(0)
    await store.flush()
    assert where(store, 3).count("memory") == 2 and where(store, 3).count("disk") == 1
    await store.close()


async def test_lookup_prefix_counts_leading_blocks_stored_for_every_key_list(
    tmp_path: Path,
) -> None:
    store = tiered(tmp_path, memory_bytes=300)
    for i in [0, 1, 2, 3, 5, 10, 11]:
        put(store, i)
    await store.flush()
    assert await store.lookup_prefix([[key(0), key(1), key(2), key(3), key(4), key(5)]]) == 4
    # Two "layouts": 0..3 and 10, 11, 9: the shorter common prefix wins.
    two = [[key(0), key(1), key(2)], [key(10), key(11), key(9)]]
    assert await store.lookup_prefix(two) == 2
    assert await store.lookup_prefix([[key(9)]]) == 0
    assert await store.lookup_prefix([]) == 0
    await store.close()


async def test_lease_promotes_from_disk_and_pins(tmp_path: Path, clock: FakeClock) -> None:
    store = tiered(tmp_path, clock=clock)
    for i in range(4):
        put(store, i)
    await store.flush()
    lease_id, leased = await store.lease([key(0), key(9)], ttl_s=10)
    assert leased == [True, False]
    for i in range(4, 8):
        put(store, i)
    assert store.memory.contains(key(0))
    clock.now += 11
    put(store, 8)
    put(store, 9)
    await store.flush()
    assert not store.memory.contains(key(0))  # lease over: evicted (to disk) again
    assert not store.release(lease_id)
    await store.close()


async def test_get_with_lease_pins_found_blocks(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    put(store, 0)
    blocks, lease_id, leased = await store.get([key(0), key(7)], lease_ttl_s=30)
    assert blocks[1] is None and leased == [True, False] and lease_id > 0
    assert store.stats().num_leases == 1
    assert store.release(lease_id)
    await store.close()


async def test_delete_removes_every_copy(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    for i in range(4):
        put(store, i)
    assert await store.delete([key(0), key(3), key(9)]) == 2
    await store.flush()
    assert where(store, 4) == ["-", "disk", "memory", "-"]
    assert not list(tmp_path.glob(f"{key(0).hex()}*"))
    await store.close()


async def test_new_put_of_a_spilled_block_keeps_tiers_exclusive(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    for i in range(3):
        put(store, i)
    await store.flush()
    assert where(store, 3) == ["disk", "memory", "memory"]
    assert put(store, 0) is PutOutcome.STORED  # memory had no copy; now it does, disk not
    await store.flush()
    assert where(store, 3) == ["memory", "disk", "memory"]
    assert store.tier("disk").snapshot().num_blocks == 1
    await store.close()


async def test_failed_puts_are_counted_by_reason(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    assert put(store, 0, size=201) is PutOutcome.NO_ROOM
    pending = store.begin_put(key(1), 100)
    assert pending is not None
    store.abort_put(pending)
    pending = store.begin_put(key(2), 100)
    assert pending is not None
    pending.write(data(2))
    assert store.commit_put(pending, 0) is PutOutcome.CORRUPT
    assert store.stats().failed_puts == {"no_room": 1, "aborted": 1, "corrupt": 1}
    await store.close()


async def test_shared_fs_below_disk_holds_every_block_for_every_store(tmp_path: Path) -> None:
    """Memory → disk → shared filesystem: the disk gets memory's evictions, the shared
    directory every committed block; a block the disk dropped, or another store's, is
    promoted from the directory, which keeps its copy."""
    layout = KVLayout(model="m", dtype="float32", block_size=16, layout_version=1)
    keys = [layout.block_key(bytes([i]) * 8) for i in range(4)]
    (tmp_path / "shared").mkdir()

    def with_shared_fs(name: str, disk_bytes: int) -> TieredStore:
        return TieredStore(
            200,
            [
                DiskSpillTier(DiskTier(tmp_path / name, capacity_bytes=disk_bytes)),
                SharedFsTier.from_path(tmp_path / "shared", 10_000),
            ],
            high_watermark=1,
            low_watermark=1,
        )

    # The disk holds one block: block 0, spilled first, is evicted from it by block 1.
    store = with_shared_fs("disk-a", disk_bytes=RECORD_HEADER_BYTES + 100)
    for i, k in enumerate(keys):
        assert put_block(store, k, data(i)) is PutOutcome.STORED
    await store.flush()
    disk, shared = store.tier("disk"), store.tier("shared_fs")
    assert isinstance(disk, DiskSpillTier) and isinstance(shared, SharedFsTier)
    assert [disk.contains(k) for k in keys] == [False, True, False, False]
    assert await shared.contains_many(keys) == [True] * 4  # written through
    blocks, _, _ = await store.get([keys[0], keys[1], layout.block_key(b"absent")])
    assert [b.data if b else None for b in blocks] == [data(0), data(1), None]
    await store.flush()
    hits = {t.tier: t.hits for t in store.stats().tiers}
    assert hits == {"memory": 0, "disk": 1, "shared_fs": 1} and store.stats().misses == 1
    assert store.memory.contains(keys[0]) and await shared.contains_many([keys[0]]) == [True]

    other = with_shared_fs("disk-b", disk_bytes=10_000)  # another replica's kvstore
    assert await other.lookup_prefix([keys]) == 4
    assert await other.delete([keys[3]]) == 1  # only the shared copy: its memory had none
    assert await other.lookup_prefix([keys]) == 3
    await store.close()
    await other.close()
