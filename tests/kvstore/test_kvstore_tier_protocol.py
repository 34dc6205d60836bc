"""The tiered store composes tiers through kvstore/tier.py's protocols: memory, disk, the
shared filesystem and Redis are each a Tier, and a tier the store has never heard of works
below memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvmesh.kvstore.block import PutOutcome, StoredBlock
from kvmesh.kvstore.disk_spill import DiskSpillTier
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.memory_tier import MemoryTier
from kvmesh.kvstore.server import build_store
from kvmesh.kvstore.shared_fs_tier import SharedFsTier
from kvmesh.kvstore.testing import numbered_key as key
from kvmesh.kvstore.testing import numbered_payload as data
from kvmesh.kvstore.testing import put_block
from kvmesh.kvstore.tier import ExclusiveTier, SharedTier, Tier, TierStats
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.services.runtime.config import KVStoreConfig


class DictSharedTier:
    """A shared tier in a dict: what another networked store would plug in as."""

    def __init__(self, name: str = "dict") -> None:
        self._name = name
        self.blocks: dict[bytes, StoredBlock] = {}
        self.reads = 0

    @property
    def name(self) -> str:
        return self._name

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.blocks for k in keys]

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        self.reads += len(keys)
        return [self.blocks.get(k) for k in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def snapshot(self) -> TierStats:
        return TierStats(len(self.blocks), sum(b.size for b in self.blocks.values()), 0, 0, 0)

    async def refresh(self) -> None:
        """Nothing to read."""

    async def flush(self) -> None:
        """Writes are done when they return."""

    async def close(self) -> None:
        """Nothing to release."""

    def write_through(self, key: bytes, block: StoredBlock) -> None:
        self.blocks[key] = block


async def test_memory_disk_shared_fs_and_redis_are_tiers(tmp_path: Path) -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e .)")
    from kvmesh.kvstore.redis_tier import RedisTier

    memory = MemoryTier(100)
    disk = DiskSpillTier(DiskTier(tmp_path / "disk", 1000))
    (tmp_path / "shared").mkdir()
    shared_fs = SharedFsTier.from_path(tmp_path / "shared", 1000)
    redis = RedisTier.from_url("redis://127.0.0.1:1/0")  # never connected here
    tiers = (memory, disk, shared_fs, redis)
    assert all(isinstance(t, Tier) for t in tiers)
    assert isinstance(disk, ExclusiveTier) and not isinstance(disk, SharedTier)
    for shared in (shared_fs, redis):
        assert isinstance(shared, SharedTier) and not isinstance(shared, ExclusiveTier)
    assert [t.name for t in tiers] == ["memory", "disk", "shared_fs", "redis"]
    await shared_fs.close()


async def test_build_store_stacks_the_configured_tiers_in_lookup_order(tmp_path: Path) -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e .)")
    (tmp_path / "shared").mkdir()
    config = KVStoreConfig(
        kvstore_disk_path=str(tmp_path / "disk"),
        kvstore_disk_bytes=10_000,
        kvstore_shared_fs_path=str(tmp_path / "shared"),
        kvstore_redis_url="redis://127.0.0.1:1/0",
    )
    store = build_store(config)
    assert [t.name for t in store.tiers] == ["memory", "disk", "shared_fs", "redis"]
    await store.tier("shared_fs").close()


async def test_a_new_shared_tier_needs_no_change_to_the_store() -> None:
    shared = DictSharedTier()
    store = TieredStore(200, [shared], high_watermark=1, low_watermark=1)
    for i in range(3):
        assert put_block(store, key(i), data(i)) is PutOutcome.STORED
    assert set(shared.blocks) == {key(0), key(1), key(2)}  # written through
    assert not store.memory.contains(key(0))  # evicted from memory, still in the dict
    assert await store.lookup_prefix([[key(0), key(1), key(2), key(3)]]) == 3
    blocks, _, _ = await store.get([key(0)])
    assert blocks[0] is not None and blocks[0].data == data(0)
    assert store.memory.contains(key(0)) and key(0) in shared.blocks  # copied up, kept
    stats = {t.tier: t for t in store.stats().tiers}
    assert stats["dict"].hits == 1 and stats["dict"].num_blocks == 3
    assert await store.delete([key(0)]) == 2  # memory + dict
    await store.close()


async def test_lookup_asks_a_lower_tier_only_past_what_the_tiers_above_hold(
    tmp_path: Path,
) -> None:
    shared = DictSharedTier()
    disk = DiskSpillTier(DiskTier(tmp_path, 10_000))
    store = TieredStore(200, [disk, shared], high_watermark=1, low_watermark=1)
    for i in range(4):
        put_block(store, key(i), data(i))
    await store.flush()
    shared.blocks[key(7)] = StoredBlock(data(7), 0)  # another kvstore's block
    keys = [key(0), key(1), key(2), key(3), key(7)]
    assert await store.lookup_prefix([keys]) == 5
    blocks, _, _ = await store.get(keys)
    assert all(b is not None for b in blocks) and shared.reads == 1  # only key(7)
    hits = {t.tier: t.hits for t in store.stats().tiers}
    assert hits == {"memory": 2, "disk": 2, "dict": 1}
    await store.close()


def test_tier_names_are_unique_and_each_lower_tier_says_how_it_is_filled() -> None:
    with pytest.raises(ValueError, match="unique"):
        TieredStore(100, [DictSharedTier("memory")])
    with pytest.raises(TypeError, match="exclusive or shared"):
        TieredStore(100, [object()])  # type: ignore[list-item]
