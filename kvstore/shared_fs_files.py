"""The files of the shared-filesystem tier: where a block lives on the volume, how it is
written so that no reader anywhere sees it torn, how it is read and verified, and how
the volume is kept under its byte bound by kvstores that never talk to each other.

Layout under the configured directory (a volume several kvstores mount):

    <root>/kvmesh-kv-v1/<namespace>/<hh>/<block hash>.blk

- ``kvmesh-kv-v1``: the record format's version (kvstore/block.py). The tier touches
  nothing outside it, so the volume may hold other things, and a future format
  gets a directory of its own instead of misreading this one.
- ``<namespace>``: the key's first 16 bytes in hex, the hash of its ``KVLayout``
  (kvstore/layout.py: model, dtype, block size, layout version, TP rank/size), as in
  every store key: two models or two KV layouts sharing a volume never see each
  other's blocks, and one layout's blocks go with one ``rm -r``.
- ``<hh>``: the block hash's first byte in hex, 256 fan-out directories as in git's
  ``objects/``: a volume of millions of blocks has no directory of millions of
  entries (slow to look up and to list, on NFS above all).
- ``<block hash>.blk``: one record, header (size, CRC-32) then the bytes.

Writes: a temporary file in the same directory (``.<hash>.<host>.<pid>.<random>.<n>.tmp``,
a name no other writer uses), renamed over the final name. A rename inside one
directory is atomic on local filesystems and on NFS, and NFS's close-to-open
consistency flushes the data to the server at the writer's close, before the rename
publishes it: a reader on any host opens a whole record or nothing. No fsync: a file
whose bytes never reached the disk before a crash fails its CRC-32 on read and is
dropped, and a cache need not survive a crash. A block already on the volume is not
written again: another replica computed the same prefix.

Recency is the file's mtime, set on a hit with ``os.utime``, not its atime: data
volumes are usually mounted ``noatime`` or ``relatime``, where a read never updates
atime or does so once a day, while an explicit utime is honoured on every mount (on
NFS the server's clock sets it, so every host's files are ordered by one clock). A
hit re-touches a file only once its mtime is ``touch_after_s`` old, so a hot block
does not cost a metadata write per read.

Eviction is a sweep: list every file (size, mtime); if they hold more than the bound,
find the mtime below which the oldest files hold the excess, then list again and
unlink the oldest of them until the volume is down to its low mark. Two listings
keep a sweep's memory at 16 bytes a file plus the paths of the files it evicts (a
volume of millions of blocks would otherwise hold millions of paths), count the
volume as it is after other sweepers' work, and spare a block read between them.
Several kvstores may sweep at once, without a lock (file locks over NFS are
unreliable): they unlink the same oldest files, one of them finds each already gone,
and the worst case is evicting a little more than needed. A file that vanishes
between a listing and its stat, or between a lookup and its read, is a miss.

Every function here blocks; kvstore/shared_fs_tier.py runs them on its threads.
"""

from __future__ import annotations

import array
import contextlib
import enum
import errno
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.kvstore.block import RECORD_HEADER_BYTES, CorruptBlockError, StoredBlock
from kvmesh.kvstore.layout import NAMESPACE_BYTES

logger = logging.getLogger(__name__)

VERSION_DIR = "kvmesh-kv-v1"
BLOCK_SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"
# A temporary file this old belongs to a writer that died mid-write (a live write
# takes milliseconds); a sweep removes it. Generous, since hosts' clocks differ.
STALE_TMP_S = 15 * 60.0
# Errors that mean "the file is not there (any more)": ESTALE is NFS's answer when
# another host removed a file this one still had a handle for.
_GONE = (errno.ENOENT, errno.ESTALE)


class SharedFsUnusable(ValueError):
    """The directory cannot hold the tier (refused at start-up, with the reason)."""


class ReadOutcome(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"  # dropped from the volume, never served
    ERROR = "error"  # unreadable for another reason: a miss, logged and counted


@dataclass(frozen=True)
class ReadResult:
    outcome: ReadOutcome
    block: StoredBlock | None = None
    detail: str = ""


@dataclass(frozen=True)
class SweepResult:
    # What the volume held when the sweep ended (this version directory only).
    num_blocks: int
    bytes_used: int
    # Files this sweep unlinked (one another sweeper removed first is not counted).
    evicted: int
    stale_tmp_removed: int
    # False when close() stopped it mid-listing: nothing was evicted.
    complete: bool = True


class SharedFsFiles:
    """Block records under ``root``/kvmesh-kv-v1, shared with every kvstore that mounts it.

    Safe to call from several threads at once: no state but the created-directory
    cache and the temporary-name counter, both only ever added to.
    """

    def __init__(self, root: str | Path) -> None:
        root = Path(root)
        if not root.is_dir():
            # Not created here: a volume that failed to mount leaves an empty mount
            # point or none, and blocks written to the container's own disk would
            # be shared with nobody.
            raise SharedFsUnusable(
                f"{root} is not a directory: mount the shared volume there first"
            )
        self.base = root / VERSION_DIR
        try:
            self.base.mkdir(exist_ok=True)
        except OSError as e:
            raise SharedFsUnusable(f"cannot create {self.base}: {e.strerror or e}") from e
        # Host and pid name the writer for a person; the random part keeps two writers
        # apart where both repeat (containers sharing a host name, pid 1 in each).
        self._writer = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        self._tmp_ids = itertools.count()
        self._made_dirs: set[Path] = set()
        self._probe()

    def path(self, key: bytes) -> Path:
        """The file of ``key`` (namespace + block hash, kvstore/layout.py)."""
        if len(key) <= NAMESPACE_BYTES:
            raise ValueError(
                f"a store key is a {NAMESPACE_BYTES}-byte namespace plus a block hash; "
                f"got {len(key)} bytes"
            )
        namespace, block_hash = key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:]
        return self.base / namespace.hex() / f"{block_hash[0]:02x}" / f"{block_hash.hex()}.blk"

    def write(self, key: bytes, block: StoredBlock) -> int:
        """Publish a block atomically; returns bytes written (0: it was there already).

        Raises OSError (the temporary file removed) if the volume refuses it.
        """
        path = self.path(key)
        if path.is_file():
            return 0
        tmp = path.with_name(f".{path.stem}.{self._writer}.{next(self._tmp_ids)}{TMP_SUFFIX}")
        if path.parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(path.parent)
        try:
            try:
                self._write_record(tmp, block)
            except FileNotFoundError:
                # Its directory was removed by hand (rm -r of a namespace): make it again.
                path.parent.mkdir(parents=True, exist_ok=True)
                self._write_record(tmp, block)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return RECORD_HEADER_BYTES + block.size

    def read(self, key: bytes, touch_after_s: float) -> ReadResult:
        """The verified block, re-touching its mtime if older than ``touch_after_s``.

        A corrupt or truncated record is unlinked (another replica may write it again).
        """
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header = f.read(RECORD_HEADER_BYTES)
                data = f.read()
                mtime = os.fstat(f.fileno()).st_mtime
        except OSError as e:
            if e.errno in _GONE:
                return ReadResult(ReadOutcome.MISS)
            return ReadResult(ReadOutcome.ERROR, detail=str(e))
        try:
            block = StoredBlock.from_parts(header, data)
        except CorruptBlockError as e:
            with contextlib.suppress(OSError):
                path.unlink()
            return ReadResult(ReadOutcome.CORRUPT, detail=str(e))
        if time.time() - mtime >= touch_after_s:
            with contextlib.suppress(OSError):  # evicted meanwhile: served all the same
                os.utime(path)
        return ReadResult(ReadOutcome.HIT, block)

    def exists(self, key: bytes) -> bool:
        return self.path(key).is_file()

    def delete(self, key: bytes) -> bool:
        """Unlink a block's file; False if it was not there."""
        try:
            self.path(key).unlink()
        except OSError as e:
            if e.errno in _GONE:
                return False
            raise
        return True

    def sweep(
        self,
        capacity_bytes: int,
        low_bytes: int,
        *,
        stop: threading.Event | None = None,
        now: Callable[[], float] = time.time,
    ) -> SweepResult:
        """Remove stale temporary files; if the volume holds more than ``capacity_bytes``,
        evict least recently used blocks down to ``low_bytes``."""
        stop = stop or threading.Event()
        # Packed (16 bytes a file), not lists of Python numbers (about 70).
        mtimes = array.array("d")
        sizes = array.array("q")
        stale = 0
        tmp_bytes = 0
        started = now()
        for entry in self._entries(stop):
            stat = _stat(entry)
            if stat is None:
                continue
            if entry.name.endswith(BLOCK_SUFFIX):
                mtimes.append(stat.st_mtime)
                sizes.append(stat.st_size)
            elif entry.name.endswith(TMP_SUFFIX):
                if started - stat.st_mtime > STALE_TMP_S:
                    stale += _unlink(entry.path)
                else:
                    tmp_bytes += stat.st_size  # a write under way takes room too
        if stop.is_set():
            return SweepResult(len(sizes), sum(sizes) + tmp_bytes, 0, stale, complete=False)
        total = sum(sizes) + tmp_bytes
        if total <= capacity_bytes or not sizes:  # under the bound, or nothing to evict
            return SweepResult(len(sizes), total, 0, stale)
        cutoff = _lru_cutoff(
            np.frombuffer(mtimes, dtype=np.float64),
            np.frombuffer(sizes, dtype=np.int64),
            total - low_bytes,
        )
        # The second listing counts again (other sweepers may have evicted meanwhile)
        # and keeps only the files old enough to go: about the excess, not the volume.
        total, num_blocks = 0, 0
        candidates: list[tuple[float, int, str]] = []
        for entry in self._entries(stop):
            stat = _stat(entry)
            if stat is None or not entry.name.endswith((BLOCK_SUFFIX, TMP_SUFFIX)):
                continue
            total += stat.st_size
            if entry.name.endswith(BLOCK_SUFFIX):
                num_blocks += 1
                # A file read since the first listing is newer than the cutoff: spared.
                if stat.st_mtime <= cutoff:
                    candidates.append((stat.st_mtime, stat.st_size, entry.path))
        if stop.is_set():
            return SweepResult(num_blocks, total, 0, stale, complete=False)
        evicted = 0
        for _, size, path in sorted(candidates):
            if total <= low_bytes:
                break
            evicted += _unlink(path)
            # Gone either way: this sweeper removed it, or another one did.
            total -= size
            num_blocks -= 1
        return SweepResult(num_blocks, total, evicted, stale)

    # -- internals ---------------------------------------------------------------

    def _write_record(self, tmp: Path, block: StoredBlock) -> None:
        with open(tmp, "wb") as f:
            f.write(block.record_header())
            f.write(block.data)

    def _probe(self) -> None:
        """Write, rename, read and remove a file now, so that a read-only mount, a wrong
        owner (the pod's user) or a filesystem without rename is refused at start-up,
        not met as one failed write per block."""
        tmp = self.base / f".probe.{self._writer}{TMP_SUFFIX}"
        final = self.base / f".probe.{self._writer}"
        try:
            tmp.write_bytes(b"kvmesh")
            os.replace(tmp, final)
            if final.read_bytes() != b"kvmesh":
                raise SharedFsUnusable(f"{self.base} does not read back what was written")
            final.unlink()
        except OSError as e:
            for leftover in (tmp, final):
                with contextlib.suppress(OSError):
                    leftover.unlink()
            raise SharedFsUnusable(
                f"{self.base} is not writable by uid {os.getuid()}: {e.strerror or e}"
            ) from e

    def _entries(self, stop: threading.Event) -> Iterator[os.DirEntry[str]]:
        """Every file two levels below the namespaces (dot-files included)."""
        for namespace in _subdirs(self.base):
            for fan_out in _subdirs(namespace.path):
                if stop.is_set():
                    return
                yield from _scan(fan_out.path)


def _lru_cutoff(mtimes: np.ndarray, sizes: np.ndarray, excess: int) -> float:
    """The smallest mtime such that files no newer than it hold at least ``excess`` bytes."""
    order = np.argsort(mtimes, kind="stable")
    held = np.cumsum(sizes[order])
    index = min(int(np.searchsorted(held, excess)), len(order) - 1)
    return float(mtimes[order[index]])


def _scan(path: str) -> list[os.DirEntry[str]]:
    """A directory's entries; none if it vanished (removed by hand, or by another host)."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError as e:
        if e.errno in _GONE or e.errno == errno.ENOTDIR:
            return []
        raise


def _subdirs(path: str | Path) -> Iterator[os.DirEntry[str]]:
    for entry in _scan(str(path)):
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                yield entry


def _stat(entry: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise


def _unlink(path: str) -> bool:
    """Unlink; False if another process removed it first."""
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno in _GONE:
            return False
        raise
    return True
