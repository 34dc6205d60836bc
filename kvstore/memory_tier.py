"""The memory tier: committed blocks, in-flight puts, leases, LRU eviction by bytes.

Every byte counts against the capacity from the moment a put begins (its
reservation), so an in-flight put can never be squeezed out, and usage never
exceeds the capacity. Eviction runs in bursts: once usage would pass the high
watermark, least recently used blocks go until it is under the low one, so a
steady stream of puts evicts (and spills) in batches instead of one block per
put. Leased blocks and in-flight puts are never evicted: leased blocks leave
the LRU queue while pinned, in-flight puts are never in it.

All operations are O(1) per block (dicts and an OrderedDict; leases expire
through a heap). Single-threaded: the service calls it from one asyncio loop.
The top ``Tier`` of the store (kvstore/tier.py); the tiered store calls its
synchronous methods directly, the lower tiers' through the protocol.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvmesh.kvstore.block import PutOutcome, StoredBlock
from kvmesh.kvstore.leases import LeaseTable
from kvmesh.kvstore.pending_put import PendingPut
from kvmesh.kvstore.tier import TierStats

logger = logging.getLogger(__name__)

# Called with (key, block) for every block evicted for room (e.g. to spill it
# to disk); not for deletes.
EvictionCallback = Callable[[bytes, StoredBlock], None]


@dataclass(frozen=True)
class MemoryTierStats:
    num_blocks: int
    # Committed blocks plus in-flight reservations; <= capacity_bytes.
    bytes_used: int
    capacity_bytes: int
    evictions: int
    # Puts refused for room (at begin, or at commit of an unreserved duplicate).
    rejected_puts: int
    num_leases: int
    pinned_bytes: int
    inflight_puts: int
    inflight_bytes: int


class MemoryTier:
    """Blocks in RAM with a byte capacity, two-phase puts, leases and watermark eviction.

    Invariants (``check_integrity``): ``bytes_used`` is the committed bytes plus
    the in-flight reservations and never exceeds the capacity; every committed
    block is pinned by a live lease or in the LRU queue, never both; no
    in-flight put is readable.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictionCallback | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        self._capacity = capacity_bytes
        self._high_bytes = int(capacity_bytes * high_watermark)
        self._low_bytes = int(capacity_bytes * low_watermark)
        self._on_evict = on_evict
        self._blocks: dict[bytes, StoredBlock] = {}
        # Unpinned keys, least recently used first: the eviction order.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._lru_bytes = 0
        # key -> number of live leases holding it.
        self._pin_counts: dict[bytes, int] = {}
        self._leases = LeaseTable(clock)
        self._inflight: set[PendingPut] = set()
        self._inflight_bytes = 0
        self._bytes_used = 0
        self._evictions = 0
        self._rejected_puts = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._blocks)

    # -- two-phase put ---------------------------------------------------------

    def begin_put(self, key: bytes, size: int) -> PendingPut | None:
        """Reserve room for a block of ``size`` bytes; None if it cannot fit.

        A key that is already stored reserves nothing: its bytes are still
        received and checked, but the stored block is kept.
        """
        self._expire_leases()
        if key in self._blocks:
            pending = PendingPut(key, size, reserved=0)
        elif self._make_room(size):
            pending = PendingPut(key, size, reserved=size)
            self._bytes_used += size
            self._inflight_bytes += size
        else:
            self._rejected_puts += 1
            return None
        self._inflight.add(pending)
        return pending

    def commit_put(self, pending: PendingPut, crc32: int) -> PutOutcome:
        """Check the put's size and CRC-32 and publish the block; ends the put either way."""
        self._expire_leases()
        self._end_put(pending)
        block = pending.assemble(crc32)
        if block is None:
            return PutOutcome.CORRUPT
        if pending.key in self._blocks:
            self._touch(pending.key)
            return PutOutcome.ALREADY_STORED
        if not self.insert(pending.key, block):
            self._rejected_puts += 1
            return PutOutcome.NO_ROOM
        return PutOutcome.STORED

    def abort_put(self, pending: PendingPut) -> None:
        """Drop an uncommitted put and its reservation (no-op if it already ended)."""
        if pending in self._inflight:
            self._end_put(pending)

    # -- blocks ----------------------------------------------------------------

    def insert(self, key: bytes, block: StoredBlock) -> bool:
        """Add a block known to be good (a promotion from a lower tier); False if no room."""
        if key in self._blocks:
            self._touch(key)
            return True
        if not self._make_room(block.size):
            return False
        self._blocks[key] = block
        self._bytes_used += block.size
        self._lru[key] = None
        self._lru_bytes += block.size
        return True

    def get(self, key: bytes) -> StoredBlock | None:
        """The block (and a recency bump), or None if absent."""
        block = self._blocks.get(key)
        if block is not None:
            self._touch(key)
        return block

    def contains(self, key: bytes) -> bool:
        """Presence only: no recency bump."""
        return key in self._blocks

    def delete(self, keys: Iterable[bytes]) -> int:
        """Drop unleased blocks; returns how many. Leased blocks stay until their lease ends."""
        self._expire_leases()
        num_deleted = 0
        for key in keys:
            if key in self._lru:
                self._remove_from_lru(key)
                self._bytes_used -= self._blocks.pop(key).size
                num_deleted += 1
        return num_deleted

    # -- as a Tier (no I/O: each answers at once) --------------------------------

    @property
    def name(self) -> str:
        return "memory"

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._blocks for key in keys]

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        return [self.get(key) for key in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        return self.delete(keys)

    def snapshot(self) -> TierStats:
        # A memory block is checked when its put commits, so none is ever corrupt here.
        stats = self.stats()
        return TierStats(stats.num_blocks, stats.bytes_used, self._capacity, stats.evictions, 0)

    async def refresh(self) -> None:
        """Nothing to read: every number is kept as it changes."""

    async def flush(self) -> None:
        """Nothing queued: every write is done when its call returns."""

    async def close(self) -> None:
        """Nothing to release: the blocks are plain memory."""

    # -- leases ----------------------------------------------------------------

    def lease(self, keys: Iterable[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        """Pin the present blocks among ``keys`` for ``ttl_s`` seconds.

        Returns the lease id (issued even if nothing was present) and, per
        key, whether it is pinned. Blocks stay pinned until ``release`` or
        expiry, whichever comes first.
        """
        self._expire_leases()
        keys = list(keys)
        present = [key in self._blocks for key in keys]
        held = tuple(dict.fromkeys(k for k, p in zip(keys, present, strict=True) if p))
        lease_id = self._leases.grant(held, ttl_s)
        for key in held:
            self._pin(key)
        return lease_id, present

    def release(self, lease_id: int) -> bool:
        """End a lease early; False if it is unknown or already ended."""
        self._expire_leases()
        lease = self._leases.revoke(lease_id)
        if lease is None:
            return False
        for key in lease.keys:
            self._unpin(key)
        return True

    # -- introspection ---------------------------------------------------------

    def stats(self) -> MemoryTierStats:
        self._expire_leases()
        return MemoryTierStats(
            num_blocks=len(self._blocks),
            bytes_used=self._bytes_used,
            capacity_bytes=self._capacity,
            evictions=self._evictions,
            rejected_puts=self._rejected_puts,
            num_leases=len(self._leases),
            pinned_bytes=self._bytes_used - self._inflight_bytes - self._lru_bytes,
            inflight_puts=len(self._inflight),
            inflight_bytes=self._inflight_bytes,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with the blocks."""
        sizes = {key: block.size for key, block in self._blocks.items()}
        assert self._inflight_bytes == sum(p.reserved for p in self._inflight), "inflight drifted"
        assert self._bytes_used == sum(sizes.values()) + self._inflight_bytes, "bytes_used drifted"
        assert self._bytes_used <= self._capacity, "over capacity"
        pinned = set(self._pin_counts)
        assert pinned.isdisjoint(self._lru), "pinned block in the LRU queue"
        assert pinned | set(self._lru) == set(sizes), "block neither pinned nor evictable"
        assert self._lru_bytes == sum(sizes[key] for key in self._lru), "lru_bytes drifted"
        expected_counts: dict[bytes, int] = {}
        for lease in self._leases:
            for key in lease.keys:
                expected_counts[key] = expected_counts.get(key, 0) + 1
        assert expected_counts == self._pin_counts, "pin counts disagree with leases"

    # -- internals -------------------------------------------------------------

    def _make_room(self, size: int) -> bool:
        """Evict so that ``size`` more bytes fit; False (evicting nothing) if they cannot."""
        if size > self._capacity:
            return False
        if self._bytes_used + size <= self._high_bytes:
            return True
        if self._bytes_used - self._lru_bytes + size > self._capacity:
            return False  # even evicting every unpinned block would not do
        while self._lru and self._bytes_used + size > self._low_bytes:
            key, _ = self._lru.popitem(last=False)
            block = self._blocks.pop(key)
            self._lru_bytes -= block.size
            self._bytes_used -= block.size
            self._evictions += 1
            if self._on_evict is not None:
                self._on_evict(key, block)
        return True

    def _end_put(self, pending: PendingPut) -> None:
        self._inflight.remove(pending)
        self._inflight_bytes -= pending.reserved
        self._bytes_used -= pending.reserved

    def _touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def _remove_from_lru(self, key: bytes) -> None:
        del self._lru[key]
        self._lru_bytes -= self._blocks[key].size

    def _pin(self, key: bytes) -> None:
        count = self._pin_counts.get(key, 0)
        if count == 0:
            self._remove_from_lru(key)
        self._pin_counts[key] = count + 1

    def _unpin(self, key: bytes) -> None:
        count = self._pin_counts[key] - 1
        if count > 0:
            self._pin_counts[key] = count
            return
        del self._pin_counts[key]
        # Released blocks were just in use: they go to the recent end.
        self._lru[key] = None
        self._lru_bytes += self._blocks[key].size

    def _expire_leases(self) -> None:
        for lease in self._leases.pop_expired():
            logger.debug("lease expired (%s blocks)", len(lease.keys))
            for key in lease.keys:
                self._unpin(key)
