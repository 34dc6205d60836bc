"""What one level of the store offers, so the tiered store composes levels it does not know.

Every level is a ``Tier``: it answers which blocks it holds, reads them
(verified: a corrupt copy is dropped and reported, never returned), deletes
them, and reports its numbers. The memory tier is the store's front (puts and
leases land there, kvstore/memory_tier.py); the levels below it say how a
block reaches them, by which protocol they also follow:

- ``ExclusiveTier`` (the disk): holds what memory evicted (``spill``), and
  drops its copy once memory holds the block again (``discard``), so memory
  and it together hold each block once and local capacity counts distinct
  blocks. Its own evictions are dropped.
- ``SharedTier`` (the shared filesystem, Redis): every block committed in
  memory is written to it (``write_through``) and a hit is copied up, never
  moved: other kvstores read the same copy.

Adding a tier: implement ``Tier`` plus one of the two, give it a unique
``name`` (the ``tier`` label of the kvstore metrics), and pass it to
``TieredStore`` in lookup order (kvstore/server.py ``build_store``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmesh.kvstore.block import StoredBlock


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers as the store reports them (the kvstore metrics)."""

    num_blocks: int
    bytes_used: int
    # 0 for a tier that bounds itself (Redis' maxmemory): no capacity seen from here.
    capacity_bytes: int
    evictions: int
    corrupt_blocks: int


@runtime_checkable
class Tier(Protocol):
    """One level of the store. Called from one asyncio loop: blocking I/O goes to a
    thread of the tier's own. Keys are a layout namespace plus a block hash
    (kvstore/layout.py); a tier that names its copies keeps the whole key in the name."""

    @property
    def name(self) -> str:
        """Unique in a store: "memory", "disk", "shared_fs", "redis"."""
        ...

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held here (a block on its way in counts)."""
        ...

    async def get_many(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Verified blocks in ``keys`` order (None: absent, corrupt or unreachable)."""
        ...

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop these keys' copies here, after any write of them already queued;
        returns how many were held."""
        ...

    def snapshot(self) -> TierStats: ...

    async def refresh(self) -> None:
        """Update numbers that need I/O to read. The server calls it every second
        (kvstore/server.py): start longer work (a listing) here, do not await it."""
        ...

    async def flush(self) -> None:
        """Wait until the writes queued so far are done."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class ExclusiveTier(Tier, Protocol):
    """Below memory, holding what memory evicted; memory and it never share a block."""

    def spill(self, key: bytes, block: StoredBlock) -> None:
        """Keep a block memory evicted, without waiting (may drop it when far behind)."""
        ...

    def discard(self, key: bytes) -> None:
        """Memory holds ``key`` again: drop this tier's copy, without waiting, ordered
        after any spill of it queued before."""
        ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """Below memory, with a copy of every committed block, shared with other kvstores."""

    def write_through(self, key: bytes, block: StoredBlock) -> None:
        """Write a block memory just committed, without waiting (may skip it when far behind)."""
        ...
