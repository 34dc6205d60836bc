"""The disk tier as the store composes it: memory's evictions spill to it, off the loop.

File I/O blocks (kvstore/disk_tier.py), so every ``put``, ``read`` and
``delete`` of the files runs on one worker thread, in submission order: the
event loop never waits on a file, and a delete queued after a write runs
after it. A block evicted from memory stays readable from a small in-RAM
spill queue until its file is written, so a lookup never misses a block in
transit. An ``ExclusiveTier`` (kvstore/tier.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvmesh.kvstore.block import StoredBlock
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.tier import TierStats

logger = logging.getLogger(__name__)

# Evicted bytes allowed to wait for the disk thread; beyond it evictions are
# dropped instead of spilled, so a slow disk cannot grow memory use.
MAX_SPILL_BACKLOG_BYTES = 256 << 20


class DiskSpillTier:
    """``disk`` behind one I/O thread and a bounded queue of blocks on their way to it."""

    def __init__(self, disk: DiskTier, max_backlog_bytes: int = MAX_SPILL_BACKLOG_BYTES) -> None:
        self.disk = disk
        self._max_backlog_bytes = max_backlog_bytes
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-disk")
        # Evicted blocks whose disk write is queued or running.
        self._spilling: dict[bytes, StoredBlock] = {}
        self._spilling_bytes = 0

    @property
    def name(self) -> str:
        return "disk"

    def contains(self, key: bytes) -> bool:
        """On disk or on its way there (no I/O: the index is in memory)."""
        return key in self._spilling or self.disk.contains(key)

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(key) for key in keys]

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        blocks = [self._spilling.get(key) for key in keys]
        on_disk = [
            key
            for key, block in zip(keys, blocks, strict=True)
            if block is None and self.disk.contains(key)
        ]
        if not on_disk:
            return blocks
        disk = self.disk
        found = await self._on_thread(lambda: {key: disk.read(key) for key in on_disk})
        return [
            block if block is not None else found.get(key)
            for key, block in zip(keys, blocks, strict=True)
        ]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        for key in keys:
            self._unspill(key)
        # Runs after any queued spill of these keys (one thread, in order),
        # so the spilled copy is counted and removed here.
        return await self._on_thread(self.disk.delete, list(keys))

    def spill(self, key: bytes, block: StoredBlock) -> None:
        if self._spilling_bytes + block.size > self._max_backlog_bytes:
            logger.debug("spill backlog full; block %s dropped", key.hex())
            return
        self._spilling[key] = block
        self._spilling_bytes += block.size
        future = self._submit(self.disk.put, key, block)

        def written(_: asyncio.Future) -> None:
            if self._spilling.get(key) is block:  # not promoted or deleted meanwhile
                self._unspill(key)

        future.add_done_callback(written)

    def discard(self, key: bytes) -> None:
        # A queued write of it is undone after it runs (same thread, in order).
        if self._unspill(key) or self.disk.contains(key):
            self._submit(self.disk.delete, [key])

    def snapshot(self) -> TierStats:
        s = self.disk.stats()
        return TierStats(
            s.num_blocks, s.bytes_used, s.capacity_bytes, s.evictions, s.corrupt_blocks
        )

    async def refresh(self) -> None:
        """Nothing to read: the disk tier keeps its numbers in memory."""

    async def flush(self) -> None:
        await self._on_thread(lambda: None)

    async def close(self) -> None:
        await self.flush()
        self._thread.shutdown(wait=True)

    def _unspill(self, key: bytes) -> bool:
        """Forget a queued spill (its disk write still runs); False if none was queued."""
        block = self._spilling.pop(key, None)
        if block is None:
            return False
        self._spilling_bytes -= block.size
        return True

    def _submit(self, fn: Callable, *args: object) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _on_thread(self, fn: Callable, *args: object) -> Any:
        return await self._submit(fn, *args)
