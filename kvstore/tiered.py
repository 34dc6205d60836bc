"""The store the service runs: memory, then the tiers below it, each a ``Tier``.

The tiers below memory are given in lookup order (kvstore/server.py builds
memory → disk → shared filesystem → Redis from the flags); kvstore/tier.py
says how each kind gets its blocks:

- Puts go to memory (two-phase, kvstore/memory_tier.py); a stored block is
  also written through to every ``SharedTier`` (the shared filesystem, Redis)
  in the background (kvstore/redis_tier.py says why).
- Memory evictions spill to the first ``ExclusiveTier`` (the disk), whose own
  evictions are dropped (a shared tier, if any, still has the block). Memory
  and an exclusive tier never both hold a block, so each byte of local
  capacity holds a distinct block.
- A hit below memory is promoted to memory: moved from an exclusive tier,
  copied from a shared one (which other kvstores read too).

Single-threaded like the memory tier: call it from one asyncio loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.kvstore.block import PutOutcome, StoredBlock
from kvmesh.kvstore.memory_tier import MemoryTier
from kvmesh.kvstore.pending_put import PendingPut
from kvmesh.kvstore.tier import ExclusiveTier, SharedTier, Tier

logger = logging.getLogger(__name__)

_FAILED_PUT_REASONS = {PutOutcome.NO_ROOM: "no_room", PutOutcome.CORRUPT: "corrupt"}

LowerTier = ExclusiveTier | SharedTier


@dataclass(frozen=True)
class TierSnapshot:
    tier: str
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    evictions: int
    corrupt_blocks: int


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierSnapshot, ...]
    misses: int
    num_leases: int
    inflight_puts: int
    # reason ("no_room", "corrupt", "aborted") -> blocks whose put stored nothing.
    failed_puts: dict[str, int]


class TieredStore:
    def __init__(
        self,
        memory_capacity_bytes: int,
        lower: Sequence[LowerTier] = (),
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``lower``: the tiers below memory, in lookup order."""
        self.memory = MemoryTier(
            memory_capacity_bytes,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            clock=clock,
            on_evict=self._spill,
        )
        self.lower = tuple(lower)
        self.tiers: tuple[Tier, ...] = (self.memory, *self.lower)
        self._exclusive = [t for t in self.lower if isinstance(t, ExclusiveTier)]
        self._shared = [t for t in self.lower if isinstance(t, SharedTier)]
        # Exactly one of the two, or the store would not know how the tier gets its blocks.
        unclear = [t for t in self.lower if (t in self._exclusive) == (t in self._shared)]
        if unclear:
            raise TypeError(f"tiers {unclear} must be exclusive or shared (kvstore/tier.py)")
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self._hits: Counter[str] = Counter()
        self._misses = 0
        self._failed_puts: Counter[str] = Counter()

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; KeyError if the store has none."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    # -- two-phase put ---------------------------------------------------------

    def begin_put(self, key: bytes, size: int) -> PendingPut | None:
        """Reserve memory for a block (None: no room; the caller drains and reports NO_ROOM)."""
        pending = self.memory.begin_put(key, size)
        if pending is None:
            self._failed_puts["no_room"] += 1
        return pending

    def commit_put(self, pending: PendingPut, crc32: int) -> PutOutcome:
        outcome = self.memory.commit_put(pending, crc32)
        if outcome in _FAILED_PUT_REASONS:
            self._failed_puts[_FAILED_PUT_REASONS[outcome]] += 1
        if outcome is PutOutcome.STORED:
            block = self.memory.get(pending.key)
            assert block is not None
            for exclusive in self._exclusive:
                exclusive.discard(pending.key)
            for shared in self._shared:
                shared.write_through(pending.key, block)
        return outcome

    def abort_put(self, pending: PendingPut) -> None:
        self.memory.abort_put(pending)
        self._failed_puts["aborted"] += 1

    # -- reads -----------------------------------------------------------------

    async def lookup_prefix(self, key_lists: Sequence[Sequence[bytes]]) -> int:
        """Leading positions whose key is stored in some tier for every list in ``key_lists``."""
        if not key_lists:
            return 0
        n = min(len(keys) for keys in key_lists)
        found: set[bytes] = set()  # held below memory

        def held(key: bytes) -> bool:
            return self.memory.contains(key) or key in found

        def first_gap(start: int) -> int:
            return next((i for i in range(start, n) if not all(held(k[i]) for k in key_lists)), n)

        gap = first_gap(0)
        for tier in self.lower:
            if gap == n:
                break
            # Each tier is asked only past what the tiers above it answered.
            asked = [keys[i] for i in range(gap, n) for keys in key_lists if not held(keys[i])]
            present = await tier.contains_many(asked)
            found.update(key for key, is_held in zip(asked, present, strict=True) if is_held)
            gap = first_gap(gap)
        return gap

    async def get(
        self, keys: Sequence[bytes], lease_ttl_s: float = 0.0
    ) -> tuple[list[StoredBlock | None], int, list[bool]]:
        """Blocks in ``keys`` order (None: miss), and if ``lease_ttl_s`` > 0 a lease on them.

        Returns (blocks, lease_id or 0, leased per key).
        """
        blocks = await self._fetch(keys, count=True)
        if lease_ttl_s <= 0:
            return blocks, 0, [False] * len(keys)
        lease_id, pinned = self.memory.lease(keys, lease_ttl_s)
        leased = [p and b is not None for p, b in zip(pinned, blocks, strict=True)]
        return blocks, lease_id, leased

    async def lease(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        """Pin blocks in memory (promoting them from lower tiers first)."""
        await self._fetch([key for key in keys if not self.memory.contains(key)], count=False)
        return self.memory.lease(keys, ttl_s)

    def release(self, lease_id: int) -> bool:
        return self.memory.release(lease_id)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Drop every copy (leased memory copies stay until their lease ends); returns how many."""
        num_deleted = 0
        for tier in self.tiers:
            num_deleted += await tier.delete_many(keys)
        return num_deleted

    # -- maintenance -----------------------------------------------------------

    async def refresh(self) -> None:
        """Update numbers that need I/O to read (Redis occupancy)."""
        for tier in self.tiers:
            await tier.refresh()

    async def flush(self) -> None:
        """Wait until queued spills and background writes are done."""
        for tier in self.tiers:
            await tier.flush()

    async def close(self) -> None:
        await self.flush()
        for tier in self.tiers:
            await tier.close()

    def stats(self) -> StoreStats:
        memory = self.memory.stats()
        tiers = []
        for tier in self.tiers:
            s = tier.snapshot()
            tiers.append(
                TierSnapshot(
                    tier.name,
                    s.num_blocks,
                    s.bytes_used,
                    s.capacity_bytes,
                    self._hits[tier.name],
                    s.evictions,
                    s.corrupt_blocks,
                )
            )
        return StoreStats(
            tiers=tuple(tiers),
            misses=self._misses,
            num_leases=memory.num_leases,
            inflight_puts=memory.inflight_puts,
            failed_puts=dict(self._failed_puts),
        )

    # -- internals -------------------------------------------------------------

    async def _fetch(self, keys: Sequence[bytes], *, count: bool) -> list[StoredBlock | None]:
        """Find blocks in any tier and promote lower-tier hits into memory."""
        blocks: list[StoredBlock | None] = [self.memory.get(key) for key in keys]
        if count:
            self._hits[self.memory.name] += sum(block is not None for block in blocks)
        for tier in self.lower:
            missing = [i for i, block in enumerate(blocks) if block is None]
            if not missing:
                break
            found = await tier.get_many([keys[i] for i in missing])
            for i, block in zip(missing, found, strict=True):
                if block is not None:
                    blocks[i] = block
                    self._promote(keys[i], block, tier)
                    if count:
                        self._hits[tier.name] += 1
        if count:
            self._misses += sum(block is None for block in blocks)
        return blocks

    def _promote(self, key: bytes, block: StoredBlock, tier: LowerTier) -> None:
        """Bring a lower-tier block into memory; an exclusive copy moves, a shared one stays."""
        if not self.memory.insert(key, block):
            return  # memory is full of leased/in-flight blocks: served, not promoted
        for exclusive in self._exclusive:
            if exclusive is tier:
                exclusive.discard(key)

    def _spill(self, key: bytes, block: StoredBlock) -> None:
        """Memory eviction callback: the block goes to the first exclusive tier, if any."""
        if self._exclusive:
            self._exclusive[0].spill(key, block)
