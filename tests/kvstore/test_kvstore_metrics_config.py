"""Metrics exported from store snapshots, and the store built from KVStoreConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.kvstore.block import crc32
from kvmesh.kvstore.metrics import StoreCollector
from kvmesh.kvstore.server import build_store
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.services.runtime.config import KVStoreConfig


def _put(store: TieredStore, key: bytes, data: bytes, checksum: int | None = None) -> None:
    pending = store.begin_put(key, len(data))
    assert pending is not None
    pending.write(data)
    store.commit_put(pending, crc32(data) if checksum is None else checksum)


async def test_collector_exports_the_snapshot(tmp_path: Path) -> None:
    config = KVStoreConfig(
        kvstore_capacity_bytes=300,
        kvstore_high_watermark=1.0,
        kvstore_low_watermark=1.0,
        kvstore_disk_path=str(tmp_path),
        kvstore_disk_bytes=10_000,
    )
    store = build_store(config)
    for i in range(4):
        _put(store, bytes([i]), b"x" * 100)
    _put(store, b"bad", b"y" * 10, checksum=0)
    await store.flush()
    await store.get([bytes([0]), bytes([3]), b"absent"], lease_ttl_s=5)  # 0 moves up, 1 down
    await store.flush()
    registry = CollectorRegistry()
    collector = StoreCollector(TieredStore(1).stats())
    registry.register(collector)
    assert registry.get_sample_value("kvmesh:kvstore_blocks", {"tier": "memory"}) == 0
    collector.update(store.stats())

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("kvmesh:kvstore_hits_total", tier="memory") == 1
    assert sample("kvmesh:kvstore_hits_total", tier="disk") == 1
    assert sample("kvmesh:kvstore_misses_total") == 1
    assert sample("kvmesh:kvstore_evictions_total", tier="memory") == 2
    assert sample("kvmesh:kvstore_failed_puts_total", reason="corrupt") == 1
    assert sample("kvmesh:kvstore_corrupt_blocks_total", source="put") == 1
    assert sample("kvmesh:kvstore_leases") == 1
    assert sample("kvmesh:kvstore_blocks", tier="memory") == 3
    assert sample("kvmesh:kvstore_blocks", tier="disk") == 1
    assert sample("kvmesh:kvstore_capacity_bytes", tier="memory") == 300
    assert sample("kvmesh:kvstore_bytes_used", tier="memory") == 300
    await store.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"kvstore_high_watermark": 0.5, "kvstore_low_watermark": 0.8},
        {"kvstore_high_watermark": 1.5},
        {"kvstore_low_watermark": 0.0},
        {"kvstore_disk_path": "/tmp/x", "kvstore_disk_bytes": 0},
        {"kvstore_max_lease_ttl_s": 0.0},
    ],
)
def test_config_rejects_inconsistent_settings(fields: dict) -> None:
    with pytest.raises(ValueError):
        KVStoreConfig(**fields)


def test_defaults_build_a_memory_only_store() -> None:
    store = build_store(KVStoreConfig())
    assert [tier.name for tier in store.tiers] == ["memory"]
    assert store.memory.capacity_bytes == 1 << 30
