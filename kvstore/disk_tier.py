"""A local-disk tier for KV blocks evicted from memory.

One file per block, named by the key's hex, written atomically (temporary file
then rename) so a crash never leaves a torn block under a valid name. The
tier keeps its own byte capacity and LRU order. The directory is owned by the
tier: block files it finds there at start are removed, since the index lives
in memory only (other files are left alone).

File I/O blocks; a service calling this from an event loop should do so in a
worker thread.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskTierStats:
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    evictions: int


class DiskTier:
    """Block bytes in files under ``directory``, bounded by ``capacity_bytes`` (LRU)."""

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self._dir.glob("*.blk"), *self._dir.glob("*.tmp")]:
            stale.unlink(missing_ok=True)
        self._capacity = capacity_bytes
        # key -> size, least recently used first.
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        self._evictions = 0

    def put(self, key: bytes, data: bytes) -> bool:
        """Write a block, evicting LRU blocks for room; False if it can never fit."""
        if len(data) > self._capacity:
            return False
        self.delete([key])
        while self._bytes_used + len(data) > self._capacity:
            old_key = next(iter(self._sizes))
            self._forget(old_key)
            self._remove_file(old_key)
            self._evictions += 1
        path = self._path(key)
        tmp_path = path.with_suffix(".tmp")
        tmp_path.write_bytes(data)
        os.replace(tmp_path, path)
        self._sizes[key] = len(data)
        self._bytes_used += len(data)
        return True

    def get(self, key: bytes) -> bytes | None:
        if key not in self._sizes:
            return None
        try:
            data = self._path(key).read_bytes()
        except OSError:
            # A file removed behind our back is a miss, not a crash: the
            # caller recomputes the KV.
            logger.warning("disk block %s unreadable; dropping it", key.hex())
            self._forget(key)
            return None
        self._sizes.move_to_end(key)
        return data

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        return [key in self._sizes for key in keys]

    def delete(self, keys: Iterable[bytes]) -> int:
        num_deleted = 0
        for key in keys:
            if key in self._sizes:
                self._forget(key)
                self._remove_file(key)
                num_deleted += 1
        return num_deleted

    def stats(self) -> DiskTierStats:
        return DiskTierStats(len(self._sizes), self._bytes_used, self._capacity, self._evictions)

    def _forget(self, key: bytes) -> None:
        self._bytes_used -= self._sizes.pop(key)

    def _path(self, key: bytes) -> Path:
        return self._dir / f"{key.hex()}.blk"

    def _remove_file(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)
