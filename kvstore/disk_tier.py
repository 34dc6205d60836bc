"""A local-disk tier for KV blocks evicted from memory.

One file per block, named by the key's hex, holding a record (header with
size and CRC-32, then the bytes; kvstore/block.py). Files are written to a
unique temporary name and renamed, so a crash or a concurrent reader never
sees a torn block under a valid name; and every read checks size and CRC-32,
so a file damaged or truncated on disk is dropped and reported, never served.
The tier keeps its own byte capacity and LRU order. The directory is owned by
the tier: block files it finds there at start are removed, since the index
lives in memory only (other files are left alone).

Threads: file I/O blocks, so the tiered store runs ``put``, ``read`` and
``delete`` on one worker thread (one at a time, in submission order);
``contains`` and ``stats`` may be called from any thread. A lock guards the
index; no I/O happens under it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.kvstore.block import RECORD_HEADER_BYTES, CorruptBlockError, StoredBlock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskTierStats:
    num_blocks: int
    # Blocks on disk plus writes under way.
    bytes_used: int
    capacity_bytes: int
    evictions: int
    corrupt_blocks: int
    write_errors: int


class DiskTier:
    """Block records in files under ``directory``, bounded by ``capacity_bytes`` (LRU)."""

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self._dir.glob("*.blk"), *self._dir.glob("*.tmp")]:
            stale.unlink(missing_ok=True)
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        # key -> record size (header included), least recently used first.
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        self._tmp_ids = itertools.count()
        self._evictions = 0
        self._corrupt_blocks = 0
        self._write_errors = 0

    def put(self, key: bytes, block: StoredBlock) -> bool:
        """Write a block, evicting LRU blocks for room; False if it can never fit or I/O failed.

        The block becomes visible (``contains``, ``read``) only once its file
        is complete.
        """
        size = RECORD_HEADER_BYTES + block.size
        if size > self._capacity:
            return False
        with self._lock:
            if key in self._sizes:
                self._bytes_used -= self._sizes.pop(key)  # the rename below replaces it
            victims = []
            while self._bytes_used + size > self._capacity:
                victim, victim_size = self._sizes.popitem(last=False)
                self._bytes_used -= victim_size
                victims.append(victim)
            self._evictions += len(victims)
            self._bytes_used += size  # reserved while writing
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)
        path = self._path(key)
        tmp_path = self._dir / f"{key.hex()}.{next(self._tmp_ids)}.tmp"
        try:
            with open(tmp_path, "wb") as f:
                f.write(block.record_header())
                f.write(block.data)
            os.replace(tmp_path, path)
        except OSError as e:
            logger.warning("disk tier: writing block %s failed: %s", key.hex(), e)
            tmp_path.unlink(missing_ok=True)
            with self._lock:
                self._bytes_used -= size
                self._write_errors += 1
            return False
        with self._lock:
            self._sizes[key] = size
        return True

    def read(self, key: bytes) -> StoredBlock | None:
        """The verified block (and a recency bump), or None if absent, unreadable or corrupt.

        A corrupt or truncated file is deleted and counted, never returned.
        """
        if not self.contains(key):
            return None
        try:
            with open(self._path(key), "rb") as f:
                header = f.read(RECORD_HEADER_BYTES)
                data = f.read()
            block = StoredBlock.from_parts(header, data)
        except CorruptBlockError as e:
            logger.warning("disk tier: block %s is corrupt (%s); dropping it", key.hex(), e)
            with self._lock:
                self._corrupt_blocks += 1
            self.delete([key])
            return None
        except OSError as e:
            # A file removed behind our back is a miss, not a crash.
            logger.warning("disk tier: block %s unreadable (%s); dropping it", key.hex(), e)
            self.delete([key])
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return block

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._sizes

    def delete(self, keys: Iterable[bytes]) -> int:
        num_deleted = 0
        for key in keys:
            with self._lock:
                size = self._sizes.pop(key, None)
                if size is None:
                    continue
                self._bytes_used -= size
            self._path(key).unlink(missing_ok=True)
            num_deleted += 1
        return num_deleted

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                num_blocks=len(self._sizes),
                bytes_used=self._bytes_used,
                capacity_bytes=self._capacity,
                evictions=self._evictions,
                corrupt_blocks=self._corrupt_blocks,
                write_errors=self._write_errors,
            )

    def _path(self, key: bytes) -> Path:
        return self._dir / f"{key.hex()}.blk"
