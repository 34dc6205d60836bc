"""Time-bounded leases: which keys each lease holds and when it ends.

The table only keeps the books; the memory tier pins and unpins the keys.
Expiry is lazy (``pop_expired`` at the start of every store operation) and
O(log n) per lease via a heap, so idle leases cost nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    keys: tuple[bytes, ...]
    expires_at: float


class LeaseTable:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        # (expires_at, lease_id); entries of released leases are skipped when popped.
        self._expiries: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def grant(self, keys: tuple[bytes, ...], ttl_s: float) -> int:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        lease_id = next(self._ids)
        expires_at = self._clock() + ttl_s
        self._leases[lease_id] = Lease(keys, expires_at)
        heapq.heappush(self._expiries, (expires_at, lease_id))
        return lease_id

    def revoke(self, lease_id: int) -> Lease | None:
        """Remove a live lease and return it (None if unknown or already ended)."""
        return self._leases.pop(lease_id, None)

    def pop_expired(self) -> list[Lease]:
        now = self._clock()
        expired = []
        while self._expiries and self._expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiries)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                expired.append(lease)
        return expired
