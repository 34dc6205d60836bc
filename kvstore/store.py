"""An in-memory store of KV block bytes keyed by content hash.

Blocks are immutable values named by the hash of what they hold, so a key
always means the same bytes; the store only decides which blocks to keep.
Eviction is least-recently-used over blocks nobody leases. A lease pins
blocks for a bounded time (a reader about to load them, a decode worker about
to pull a prefill's KV) and expires on its own, so a crashed reader cannot pin
memory forever.

The store knows nothing about requests. It is single-threaded: the service
calls it from one asyncio loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Called with (key, data) for every block evicted for lack of room, e.g. to
# spill it to a slower tier. Not called for explicit deletes.
EvictionCallback = Callable[[bytes, bytes], None]


@dataclass(frozen=True)
class BlockStoreStats:
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    # get() outcomes.
    hits: int
    misses: int
    # Blocks dropped to make room (not explicit deletes).
    evictions: int
    # put() calls refused: block larger than the capacity, or no evictable room.
    rejected_puts: int
    num_leases: int
    pinned_bytes: int


@dataclass(frozen=True)
class _Lease:
    keys: tuple[bytes, ...]
    expires_at: float


class BlockStore:
    """Content-addressed block bytes with a byte capacity, LRU eviction and leases.

    Invariants (checked by ``check_integrity``): ``bytes_used <= capacity``;
    every block is either pinned by at least one live lease or in the LRU
    queue, never both.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictionCallback | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._clock = clock
        self._on_evict = on_evict
        self._blocks: dict[bytes, bytes] = {}
        # Unpinned keys, least recently used first: the eviction order.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        # key -> number of live leases holding it.
        self._pin_counts: dict[bytes, int] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_expiries: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._bytes_used = 0
        self._pinned_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected_puts = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, data: bytes) -> bool:
        """Store ``data`` under ``key``, evicting unleased LRU blocks if needed.

        Returns False, changing nothing, when the block cannot fit: larger
        than the capacity, or more room needed than unleased blocks free.
        """
        self._expire_leases()
        old = self._blocks.get(key)
        old_size = 0 if old is None else len(old)
        growth = len(data) - old_size
        room_needed = self._bytes_used + growth - self._capacity
        if room_needed > 0:
            # The block being replaced cannot make room for itself.
            own_evictable = old_size if key in self._lru else 0
            evictable = self._bytes_used - self._pinned_bytes - own_evictable
            if len(data) > self._capacity or room_needed > evictable:
                self._rejected_puts += 1
                logger.debug(
                    "refused block %s (%s bytes): %s bytes needed, %s evictable",
                    key.hex(),
                    len(data),
                    room_needed,
                    evictable,
                )
                return False
            self._evict(room_needed, keep=key)
        self._blocks[key] = data
        self._bytes_used += growth
        if key in self._pin_counts:
            self._pinned_bytes += growth
        else:
            self._lru[key] = None
            self._lru.move_to_end(key)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes (and a recency bump), or None if absent."""
        self._expire_leases()
        data = self._blocks.get(key)
        if data is None:
            self._misses += 1
            return None
        self._hits += 1
        if key in self._lru:
            self._lru.move_to_end(key)
        return data

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Presence of each key; does not count as a use for LRU or hit stats."""
        self._expire_leases()
        return [key in self._blocks for key in keys]

    def delete(self, keys: Iterable[bytes]) -> int:
        """Drop unleased blocks; returns how many were dropped.

        Leased blocks stay: a lease promises its holder the bytes until it is
        released or expires.
        """
        self._expire_leases()
        num_deleted = 0
        for key in keys:
            if key in self._lru:
                del self._lru[key]
                self._bytes_used -= len(self._blocks.pop(key))
                num_deleted += 1
        return num_deleted

    def lease(self, keys: Iterable[bytes], ttl_s: float) -> int:
        """Pin the present blocks among ``keys`` for ``ttl_s`` seconds; returns the lease id.

        Absent keys are ignored (check ``contains`` after leasing to learn
        which blocks the lease holds). Blocks stay pinned until ``release`` or
        expiry, whichever comes first.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._expire_leases()
        present = tuple(dict.fromkeys(key for key in keys if key in self._blocks))
        lease_id = next(self._lease_ids)
        expires_at = self._clock() + ttl_s
        self._leases[lease_id] = _Lease(present, expires_at)
        heapq.heappush(self._lease_expiries, (expires_at, lease_id))
        for key in present:
            self._pin(key)
        return lease_id

    def release(self, lease_id: int) -> bool:
        """End a lease early. Returns False if it is unknown or already expired."""
        self._expire_leases()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for key in lease.keys:
            self._unpin(key)
        return True

    def stats(self) -> BlockStoreStats:
        self._expire_leases()
        return BlockStoreStats(
            num_blocks=len(self._blocks),
            bytes_used=self._bytes_used,
            capacity_bytes=self._capacity,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            rejected_puts=self._rejected_puts,
            num_leases=len(self._leases),
            pinned_bytes=self._pinned_bytes,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with the blocks."""
        sizes = {key: len(data) for key, data in self._blocks.items()}
        assert self._bytes_used == sum(sizes.values()), "bytes_used drifted"
        assert self._bytes_used <= self._capacity, "over capacity"
        pinned = set(self._pin_counts)
        assert pinned.isdisjoint(self._lru), "pinned block in the LRU queue"
        assert pinned | set(self._lru) == set(sizes), "block neither pinned nor evictable"
        assert self._pinned_bytes == sum(sizes[key] for key in pinned), "pinned_bytes drifted"
        expected_counts: dict[bytes, int] = {}
        for lease in self._leases.values():
            for key in lease.keys:
                expected_counts[key] = expected_counts.get(key, 0) + 1
        assert expected_counts == self._pin_counts, "pin counts disagree with leases"

    def _evict(self, num_bytes: int, keep: bytes) -> None:
        """Drop LRU unpinned blocks (never ``keep``) until ``num_bytes`` are freed."""
        freed = 0
        kept_position = keep in self._lru
        if kept_position:
            del self._lru[keep]
        while freed < num_bytes:
            key, _ = self._lru.popitem(last=False)
            data = self._blocks.pop(key)
            freed += len(data)
            self._bytes_used -= len(data)
            self._evictions += 1
            if self._on_evict is not None:
                self._on_evict(key, data)
        if kept_position:
            self._lru[keep] = None

    def _pin(self, key: bytes) -> None:
        count = self._pin_counts.get(key, 0)
        if count == 0:
            del self._lru[key]
            self._pinned_bytes += len(self._blocks[key])
        self._pin_counts[key] = count + 1

    def _unpin(self, key: bytes) -> None:
        count = self._pin_counts[key] - 1
        if count > 0:
            self._pin_counts[key] = count
            return
        del self._pin_counts[key]
        self._pinned_bytes -= len(self._blocks[key])
        # Released blocks were just in use: they go to the recent end.
        self._lru[key] = None

    def _expire_leases(self) -> None:
        now = self._clock()
        while self._lease_expiries and self._lease_expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_expiries)
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue  # released earlier
            logger.debug("lease %s expired (%s blocks)", lease_id, len(lease.keys))
            for key in lease.keys:
                self._unpin(key)
