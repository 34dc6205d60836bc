"""A shared-filesystem tier: a directory that several kvstores mount, written through.

The volume is a Kubernetes ReadWriteMany claim, an NFS export, or a node-local path
that the replicas on one host share. Every block committed in memory is written
there in the background; a kvstore whose memory misses a prefix that another
kvstore computed finds the file and copies it up. No server process: the
filesystem is the protocol (kvstore/shared_fs_files.py: atomic renames, CRC-32 on
every read, a byte bound kept by sweeps that evict the least recently used files).
A ``SharedTier`` (kvstore/tier.py), like Redis; unlike Redis it bounds its volume
itself and keeps blocks across restarts of every kvstore.

Threads: file calls block (an NFS round trip each), so reads, writes and deletes
run on a small pool (``io_threads``: reads of one lookup proceed in parallel) and
sweeps on a thread of their own, so a long listing never delays a read. Every
number the store reports is kept on the event loop.

The bound: each kvstore counts what it wrote since its last sweep and sweeps when
that count says the volume is full, and every ``sweep_interval_s`` regardless, to
see the others' writes. Between sweeps the volume may exceed its bound by what the
other kvstores wrote meanwhile: leave that much headroom on the volume, and give
every kvstore that shares it the same bound (the smallest one wins).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvmesh.kvstore.block import StoredBlock
from kvmesh.kvstore.shared_fs_files import ReadOutcome, ReadResult, SharedFsFiles, SweepResult
from kvmesh.kvstore.tier import TierStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Bytes of background writes allowed in flight; beyond it new writes are skipped
# (counted) so a slow volume cannot grow the kvstore's memory.
MAX_PENDING_WRITE_BYTES = 256 << 20
# Reads of one lookup in parallel: an NFS read is a round trip, not CPU.
DEFAULT_IO_THREADS = 4
# How often a kvstore lists the volume to see the other kvstores' writes.
DEFAULT_SWEEP_INTERVAL_S = 30.0
# A sweep evicts down to this fraction of the bound, so it does not run again at
# the next write.
DEFAULT_LOW_WATERMARK = 0.9
# A hit re-touches a file's mtime only if it is older than this (one metadata write
# per hot block per minute, not per read; LRU at minute resolution).
DEFAULT_TOUCH_AFTER_S = 60.0


@dataclass(frozen=True)
class SharedFsTierStats:
    # As of the last sweep, plus this kvstore's writes and deletes since.
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    evictions: int
    corrupt_blocks: int
    # Blocks this kvstore wrote, and those another kvstore had written first.
    writes: int
    already_present: int
    # Background writes dropped because MAX_PENDING_WRITE_BYTES were in flight.
    writes_skipped: int
    write_errors: int
    read_errors: int
    sweeps: int
    stale_tmp_removed: int


class SharedFsTier:
    def __init__(
        self,
        files: SharedFsFiles,
        capacity_bytes: int,
        *,
        low_watermark: float = DEFAULT_LOW_WATERMARK,
        io_threads: int = DEFAULT_IO_THREADS,
        max_pending_bytes: int = MAX_PENDING_WRITE_BYTES,
        sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
        touch_after_s: float = DEFAULT_TOUCH_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0 < low_watermark <= 1:
            raise ValueError(f"low_watermark must be in (0, 1], got {low_watermark}")
        self.files = files
        self._capacity = capacity_bytes
        self._low_bytes = int(capacity_bytes * low_watermark)
        self._max_pending_bytes = max_pending_bytes
        self._sweep_interval_s = sweep_interval_s
        self._touch_after_s = touch_after_s
        self._clock = clock
        self._io_threads = io_threads
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-shared-fs")
        self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="kvstore-shared-fs-sweep")
        self._closing = threading.Event()
        # Blocks whose write is queued or running: served from here meanwhile.
        self._writing: dict[bytes, StoredBlock] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._pending_bytes = 0
        self._sweep_task: asyncio.Task[SweepResult | None] | None = None
        self._last_sweep: float | None = None
        # The volume as the last sweep saw it, and this kvstore's changes since.
        self._swept_blocks = 0
        self._swept_bytes = 0
        self._blocks_since = 0
        self._bytes_since = 0
        self._healthy = True
        self._evictions = 0
        self._corrupt_blocks = 0
        self._writes = 0
        self._already_present = 0
        self._writes_skipped = 0
        self._write_errors = 0
        self._read_errors = 0
        self._sweeps = 0
        self._stale_tmp_removed = 0

    @classmethod
    def from_path(cls, path: str | Path, capacity_bytes: int) -> SharedFsTier:
        """The tier over a mounted directory; SharedFsUnusable says why it cannot be."""
        return cls(SharedFsFiles(path), capacity_bytes)

    @property
    def name(self) -> str:
        return "shared_fs"

    # -- writes ----------------------------------------------------------------

    def write_through(self, key: bytes, block: StoredBlock) -> None:
        """Start writing a block without waiting (skipped if too many bytes are in flight)."""
        if key in self._writing:
            return
        if self._pending_bytes + block.size > self._max_pending_bytes:
            self._writes_skipped += 1
            return
        self._writing[key] = block
        self._pending_bytes += block.size
        task = asyncio.create_task(self._write(key, block))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, key: bytes, block: StoredBlock) -> None:
        try:
            written = await self._on(self._io, self.files.write, key, block)
        except OSError as e:
            self._write_errors += 1
            self._failed(f"writing block {key.hex()}", e)
            return
        finally:
            self._pending_bytes -= block.size
            if self._writing.get(key) is block:  # not deleted meanwhile
                del self._writing[key]
        self._succeeded()
        if written == 0:
            self._already_present += 1
            return
        self._writes += 1
        self._blocks_since += 1
        self._bytes_since += written
        if self._swept_bytes + self._bytes_since > self._capacity:
            self._start_sweep()

    async def flush(self) -> None:
        """Wait for the background writes started so far."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    # -- reads -----------------------------------------------------------------

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's file exists (or its write is under way): one stat per key,
        split over the I/O threads (each an NFS round trip)."""
        asked = [key for key in keys if key not in self._writing]
        if not asked:
            return [True] * len(keys)
        files = self.files

        def exist(part: list[bytes]) -> dict[bytes, bool]:
            return {key: files.exists(key) for key in part}

        parts = [asked[i :: self._io_threads] for i in range(min(self._io_threads, len(asked)))]
        found: dict[bytes, bool] = {}
        try:
            for answers in await asyncio.gather(*(self._on(self._io, exist, p) for p in parts)):
                found.update(answers)
        except OSError as e:
            self._read_errors += 1
            self._failed("looking up blocks", e)
        return [key in self._writing or found.get(key, False) for key in keys]

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Verified blocks in ``keys`` order (None: absent, corrupt or unreadable)."""
        blocks = [self._writing.get(key) for key in keys]
        asked = [i for i, block in enumerate(blocks) if block is None]
        results = await asyncio.gather(
            *(self._on(self._io, self.files.read, keys[i], self._touch_after_s) for i in asked)
        )
        for i, result in zip(asked, results, strict=True):
            blocks[i] = self._count_read(keys[i], result)
        return blocks

    def _count_read(self, key: bytes, result: ReadResult) -> StoredBlock | None:
        if result.outcome is ReadOutcome.CORRUPT:
            logger.warning(
                "shared-fs tier: block %s is corrupt (%s); dropped it", key.hex(), result.detail
            )
            self._corrupt_blocks += 1
            self._blocks_since -= 1
        elif result.outcome is ReadOutcome.ERROR:
            self._read_errors += 1
            self._failed(f"reading block {key.hex()}", OSError(result.detail))
        return result.block

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        await self.flush()  # a write still in flight would bring the block back
        files = self.files
        try:
            deleted = await self._on(self._io, lambda: sum(files.delete(k) for k in keys))
        except OSError as e:
            self._failed("deleting blocks", e)
            return 0
        self._blocks_since -= deleted
        return deleted

    # -- the bound -------------------------------------------------------------

    async def sweep(self) -> SweepResult | None:
        """List the volume now and evict down to the low mark if it is over its bound
        (joins a sweep already running); None if the listing failed."""
        self._start_sweep()
        assert self._sweep_task is not None
        return await asyncio.shield(self._sweep_task)

    def _start_sweep(self) -> None:
        if self._sweep_task is None or self._sweep_task.done():
            self._sweep_task = asyncio.create_task(self._run_sweep())

    async def _run_sweep(self) -> SweepResult | None:
        # Changes made before the listing starts are in it; those made while it runs
        # may be counted twice (an early next sweep, never a missed one).
        blocks_before, bytes_before = self._blocks_since, self._bytes_since
        self._last_sweep = self._clock()
        try:
            result = await self._on(
                self._sweeper,
                self.files.sweep,
                self._capacity,
                self._low_bytes,
                stop=self._closing,
            )
        except OSError as e:
            self._failed("sweeping the volume", e)
            return None
        self._sweeps += 1
        self._evictions += result.evicted
        self._stale_tmp_removed += result.stale_tmp_removed
        self._swept_blocks, self._swept_bytes = result.num_blocks, result.bytes_used
        self._blocks_since -= blocks_before
        self._bytes_since -= bytes_before
        return result

    # -- reporting -------------------------------------------------------------

    async def refresh(self) -> None:
        """Start a sweep (not waited for) if the last one is ``sweep_interval_s`` old:
        the only way this kvstore learns what the others wrote."""
        if self._last_sweep is None or self._clock() - self._last_sweep >= self._sweep_interval_s:
            self._start_sweep()

    def snapshot(self) -> TierStats:
        s = self.stats()
        return TierStats(
            s.num_blocks, s.bytes_used, s.capacity_bytes, s.evictions, s.corrupt_blocks
        )

    def stats(self) -> SharedFsTierStats:
        return SharedFsTierStats(
            num_blocks=max(0, self._swept_blocks + self._blocks_since),
            bytes_used=max(0, self._swept_bytes + self._bytes_since),
            capacity_bytes=self._capacity,
            evictions=self._evictions,
            corrupt_blocks=self._corrupt_blocks,
            writes=self._writes,
            already_present=self._already_present,
            writes_skipped=self._writes_skipped,
            write_errors=self._write_errors,
            read_errors=self._read_errors,
            sweeps=self._sweeps,
            stale_tmp_removed=self._stale_tmp_removed,
        )

    async def close(self) -> None:
        await self.flush()
        self._closing.set()  # a sweep still listing stops without evicting
        if self._sweep_task is not None:
            await asyncio.gather(self._sweep_task, return_exceptions=True)
        self._io.shutdown(wait=True)
        self._sweeper.shutdown(wait=True)

    # -- internals -------------------------------------------------------------

    async def _on(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: fn(*args, **kw))

    def _failed(self, what: str, error: BaseException) -> None:
        # One warning per outage (an unmounted or full volume), not one per block.
        if self._healthy:
            logger.warning("shared-fs tier: %s failed (%s); treating it as a miss", what, error)
            self._healthy = False

    def _succeeded(self) -> None:
        if not self._healthy:
            logger.info("shared-fs tier: the volume answers again")
            self._healthy = True
