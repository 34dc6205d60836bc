"""The store the service runs: memory, then optional disk, then optional Redis.

- Puts go to memory (two-phase, kvstore/memory_tier.py); a stored block is
  also written through to Redis in the background (kvstore/redis_tier.py says
  why).
- Memory evictions spill to disk. Memory and disk are exclusive (a block
  lives in one of them), so each byte of local capacity holds a distinct
  block; disk evictions are dropped (Redis, if any, still has the block).
- A hit in disk or Redis is promoted to memory (moved from disk, copied from
  Redis, which other kvstores share).

Disk I/O runs on one worker thread, in submission order, so the event loop
never waits on a file and a delete queued after a write runs after it. A
block evicted from memory stays readable from a small in-RAM spill queue
until its file is written, so a lookup never misses a block in transit.

Single-threaded like the memory tier: call it from one asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.block import PutOutcome, StoredBlock
from kvstore.disk_tier import DiskTier
from kvstore.memory_tier import MemoryTier
from kvstore.pending_put import PendingPut

if TYPE_CHECKING:  # redis-py is imported only where a Redis tier is configured
    from kvstore.redis_tier import RedisTier

logger = logging.getLogger(__name__)

# Evicted bytes allowed to wait for the disk thread; beyond it evictions are
# dropped instead of spilled, so a slow disk cannot grow memory use.
MAX_SPILL_BACKLOG_BYTES = 256 << 20

_FAILED_PUT_REASONS = {PutOutcome.NO_ROOM: "no_room", PutOutcome.CORRUPT: "corrupt"}


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
        *,
        disk: DiskTier | None = None,
        redis: RedisTier | None = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.memory = MemoryTier(
            memory_capacity_bytes,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            clock=clock,
            on_evict=self._spill,
        )
        self.disk = disk
        self.redis = redis
        self._disk_thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-disk") if disk else None
        )
        # Evicted blocks whose disk write is queued or running.
        self._spilling: dict[bytes, StoredBlock] = {}
        self._spilling_bytes = 0
        self._hits: Counter[str] = Counter()
        self._misses = 0
        self._failed_puts: Counter[str] = Counter()

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
            self._drop_lower_local_copy(pending.key)
            if self.redis is not None:
                self.redis.put_in_background(pending.key, block)
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
        num_local = next(
            (i for i in range(n) if not all(self._has_local(keys[i]) for keys in key_lists)), n
        )
        if num_local == n or self.redis is None:
            return num_local
        remote_keys = [
            keys[i]
            for i in range(num_local, n)
            for keys in key_lists
            if not self._has_local(keys[i])
        ]
        in_redis = dict(zip(remote_keys, await self.redis.exists_many(remote_keys), strict=True))
        for i in range(num_local, n):
            if not all(self._has_local(keys[i]) or in_redis.get(keys[i]) for keys in key_lists):
                return i
        return n

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
        num_deleted = self.memory.delete(keys)
        if self.disk is not None:
            for key in keys:
                self._unspill(key)
            # Runs after any queued spill of these keys (one thread, in order),
            # so the spilled copy is counted and removed here.
            num_deleted += await self._on_disk_thread(self.disk.delete, list(keys))
        if self.redis is not None:
            await self.redis.flush()  # a write still in flight would resurrect the block
            num_deleted += await self.redis.delete_many(keys)
        return num_deleted

    # -- maintenance -----------------------------------------------------------

    async def refresh(self) -> None:
        """Update numbers that need I/O to read (Redis occupancy)."""
        if self.redis is not None:
            await self.redis.refresh_stats()

    async def flush(self) -> None:
        """Wait until queued spills and background Redis writes are done."""
        if self.disk is not None:
            await self._on_disk_thread(lambda: None)
        if self.redis is not None:
            await self.redis.flush()

    async def close(self) -> None:
        await self.flush()
        if self._disk_thread is not None:
            self._disk_thread.shutdown(wait=True)
        if self.redis is not None:
            await self.redis.close()

    def stats(self) -> StoreStats:
        memory = self.memory.stats()
        # (tier, blocks, bytes used, capacity, evictions, corrupt blocks)
        rows = [("memory", memory.num_blocks, memory.bytes_used, memory.capacity_bytes,
                 memory.evictions, 0)]  # fmt: skip
        if self.disk is not None:
            disk = self.disk.stats()
            rows.append(("disk", disk.num_blocks, disk.bytes_used, disk.capacity_bytes,
                         disk.evictions, disk.corrupt_blocks))  # fmt: skip
        if self.redis is not None:
            redis = self.redis.stats()
            # Redis bounds itself (maxmemory): no capacity or evictions seen from here.
            rows.append(("redis", redis.num_blocks, redis.bytes_used, 0, 0, redis.corrupt_blocks))
        tiers = [
            TierSnapshot(name, blocks, used, capacity, self._hits[name], evictions, corrupt)
            for name, blocks, used, capacity, evictions, corrupt in rows
        ]
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
        blocks: list[StoredBlock | None] = []
        for key in keys:
            block = self.memory.get(key)
            if block is None and key in self._spilling:
                block = self._spilling[key]
                self._promote(key, block, "disk")  # the queued write is undone after it runs
            blocks.append(block)
        if count:
            self._hits["memory"] += sum(block is not None for block in blocks)
        for tier, read in self._lower_tiers():
            missing = [i for i, block in enumerate(blocks) if block is None]
            if not missing:
                break
            found = await read([keys[i] for i in missing])
            for i, block in zip(missing, found, strict=True):
                if block is not None:
                    blocks[i] = block
                    self._promote(keys[i], block, tier)
                    if count:
                        self._hits[tier] += 1
        if count:
            self._misses += sum(block is None for block in blocks)
        return blocks

    def _lower_tiers(self) -> list[tuple[str, Callable]]:
        tiers: list[tuple[str, Callable]] = []
        if self.disk is not None:
            tiers.append(("disk", self._read_disk))
        if self.redis is not None:
            tiers.append(("redis", self.redis.get_many))
        return tiers

    async def _read_disk(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        assert self.disk is not None
        on_disk = [key for key in keys if self.disk.contains(key)]
        if not on_disk:
            return [None] * len(keys)
        disk = self.disk
        found = await self._on_disk_thread(lambda: {key: disk.read(key) for key in on_disk})
        return [found.get(key) for key in keys]

    def _promote(self, key: bytes, block: StoredBlock, tier: str) -> None:
        """Bring a lower-tier block into memory; a disk copy moves, a Redis copy stays."""
        if not self.memory.insert(key, block):
            return  # memory is full of leased/in-flight blocks: served, not promoted
        if tier == "disk":
            self._drop_lower_local_copy(key)

    def _drop_lower_local_copy(self, key: bytes) -> None:
        """Keep memory and disk exclusive once ``key`` is in memory."""
        if self.disk is None:
            return
        if self._unspill(key) or self.disk.contains(key):
            self._submit_to_disk_thread(self.disk.delete, [key])

    def _has_local(self, key: bytes) -> bool:
        return (
            self.memory.contains(key)
            or key in self._spilling
            or (self.disk is not None and self.disk.contains(key))
        )

    def _spill(self, key: bytes, block: StoredBlock) -> None:
        """Memory eviction callback: queue the block for the disk tier."""
        if self.disk is None:
            return
        if self._spilling_bytes + block.size > MAX_SPILL_BACKLOG_BYTES:
            logger.debug("spill backlog full; block %s dropped", key.hex())
            return
        self._spilling[key] = block
        self._spilling_bytes += block.size
        future = self._submit_to_disk_thread(self.disk.put, key, block)

        def written(_: asyncio.Future) -> None:
            if self._spilling.get(key) is block:  # not promoted or deleted meanwhile
                self._unspill(key)

        future.add_done_callback(written)

    def _unspill(self, key: bytes) -> bool:
        """Forget a queued spill (its disk write still runs); False if none was queued."""
        block = self._spilling.pop(key, None)
        if block is None:
            return False
        self._spilling_bytes -= block.size
        return True

    def _submit_to_disk_thread(self, fn: Callable, *args: object) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._disk_thread, fn, *args)

    async def _on_disk_thread(self, fn: Callable, *args: object) -> Any:
        return await self._submit_to_disk_thread(fn, *args)
