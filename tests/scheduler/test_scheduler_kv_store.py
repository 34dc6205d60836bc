"""The scheduler's side of the KV connector over the SchedulerKVStore protocol: prefix
lookups and transfer leases driven by an in-memory store, its failures included."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.kvstore.client import KVStoreError, Lease
from kvmesh.kvstore.layout import KVLayout
from kvmesh.scheduler.kv_leases import StoreLeases
from kvmesh.scheduler.kv_lookup import StorePrefixLookup
from kvmesh.scheduler.kv_store import SchedulerKVStore
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash

BLOCK = 4
RANK0 = KVLayout("m", "float32", BLOCK, 1, tp_rank=0, tp_size=2)
RANK1 = KVLayout("m", "float32", BLOCK, 1, tp_rank=1, tp_size=2)


class MemoryStore:
    """Block hashes stored per layout; ``failing`` layouts (or all) raise like a dead store."""

    def __init__(self) -> None:
        self.stored: dict[KVLayout, set[bytes]] = {RANK0: set(), RANK1: set()}
        self.failing: set[KVLayout] = set()
        self.down = False
        self.leases: dict[int, KVLayout] = {}
        self.released: list[int] = []

    def _check(self, layout: KVLayout | None = None) -> None:
        if self.down or layout in self.failing:
            raise KVStoreError("unreachable")

    async def lookup_prefix(
        self,
        layouts: Sequence[KVLayout],
        block_hashes: Sequence[bytes],
        *,
        timeout_s: float | None = None,
    ) -> int:
        self._check()
        for index, block_hash in enumerate(block_hashes):
            if not all(block_hash in self.stored[layout] for layout in layouts):
                return index
        return len(block_hashes)

    async def lease(
        self,
        layout: KVLayout,
        block_hashes: Sequence[bytes],
        ttl_s: float,
        *,
        timeout_s: float | None = None,
    ) -> Lease:
        self._check(layout)
        lease_id = len(self.leases) + 1
        self.leases[lease_id] = layout
        return Lease(lease_id, tuple(h in self.stored[layout] for h in block_hashes))

    async def release(self, lease_id: int, *, timeout_s: float | None = None) -> bool:
        self._check()
        self.released.append(lease_id)
        return lease_id in self.leases


def _hashes(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, BLOCK, None, sha256_block_hash)
    return hashes


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


async def test_lookup_returns_the_stored_prefix_under_every_layout(store: MemoryStore) -> None:
    prompt = list(range(14))  # 3 full blocks, 2 tokens left over
    hashes = _hashes(prompt)
    store.stored[RANK0].update(hashes)
    store.stored[RANK1].update(hashes[:2])
    typed: SchedulerKVStore = store
    lookup = StorePrefixLookup(typed, [RANK0, RANK1], BLOCK, sha256_block_hash)
    assert await lookup.lookup(prompt, cache_salt=None) == hashes[:2]
    assert await lookup.lookup(prompt, cache_salt="other tenant") == []
    assert await lookup.lookup([1, 2, 3], cache_salt=None) == []  # no full block


async def test_a_store_that_fails_is_a_miss_until_it_answers(store: MemoryStore) -> None:
    prompt = list(range(8))
    store.stored[RANK0].update(_hashes(prompt))
    lookup = StorePrefixLookup(store, [RANK0], BLOCK, sha256_block_hash)
    store.down = True
    assert await lookup.lookup(prompt, cache_salt=None) is None
    store.down = False
    assert await lookup.lookup(prompt, cache_salt=None) == _hashes(prompt)


async def test_leases_cover_the_blocks_pinned_under_every_layout(store: MemoryStore) -> None:
    hashes = _hashes(list(range(12)))
    store.stored[RANK0].update(hashes)
    store.stored[RANK1].update(hashes[:1])
    leases = StoreLeases(store, [RANK0, RANK1], ttl_s=5)
    assert await leases.lease(hashes) == ([1, 2], 1)
    store.stored[RANK1].clear()
    assert await leases.lease(hashes) == ([], 0)  # nothing usable: both leases end
    await leases.drain()
    assert store.released == [3, 4]


async def test_a_lease_refused_on_one_layout_ends_the_others(store: MemoryStore) -> None:
    hashes = _hashes(list(range(8)))
    for layout in (RANK0, RANK1):
        store.stored[layout].update(hashes)
    store.failing.add(RANK1)
    leases = StoreLeases(store, [RANK0, RANK1], ttl_s=5)
    assert await leases.lease(hashes) == ([], 0)
    await leases.drain()
    assert store.released == [1]  # rank 0's lease, granted before rank 1 failed
