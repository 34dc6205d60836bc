"""Memory tier over a disk tier: evicted blocks spill to disk, hits come back.

Tiers are exclusive: a block lives in memory or on disk, not both, so each
byte of capacity holds a distinct block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvstore.disk_tier import DiskTier
from kvstore.store import BlockStore, BlockStoreStats

logger = logging.getLogger(__name__)


class TieredBlockStore:
    """The ``BlockStore`` interface over memory plus a ``DiskTier``."""

    def __init__(
        self,
        memory_capacity_bytes: int,
        disk: DiskTier,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._disk = disk
        self.memory = BlockStore(memory_capacity_bytes, clock=clock, on_evict=self._spill)

    @property
    def disk(self) -> DiskTier:
        return self._disk

    def put(self, key: bytes, data: bytes) -> bool:
        if self.memory.put(key, data):
            self._disk.delete([key])  # a stale spilled copy must not linger
            return True
        # Memory is full of leased blocks (or the block is too big for it).
        return self._disk.put(key, data)

    def get(self, key: bytes) -> bytes | None:
        data = self.memory.get(key)
        if data is not None:
            return data
        data = self._disk.get(key)
        if data is not None and self.memory.put(key, data):
            self._disk.delete([key])
        return data

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        keys = list(keys)
        in_memory = self.memory.contains(keys)
        on_disk = self._disk.contains(keys)
        return [m or d for m, d in zip(in_memory, on_disk, strict=True)]

    def delete(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        return self.memory.delete(keys) + self._disk.delete(keys)

    def lease(self, keys: Iterable[bytes], ttl_s: float) -> int:
        """Lease blocks; those on disk are first brought into memory, where leases live."""
        keys = list(keys)
        for key, in_memory in zip(keys, self.memory.contains(keys), strict=True):
            if not in_memory:
                self.get(key)
        return self.memory.lease(keys, ttl_s)

    def release(self, lease_id: int) -> bool:
        return self.memory.release(lease_id)

    def stats(self) -> BlockStoreStats:
        """Memory-tier stats (see ``disk.stats()`` for the disk tier)."""
        return self.memory.stats()

    def _spill(self, key: bytes, data: bytes) -> None:
        if not self._disk.put(key, data):
            logger.debug("block %s too large for the disk tier; dropped", key.hex())
