"""What the scheduler's side of the KV connector asks of the kvstore.

``StorePrefixLookup`` (kv_lookup.py) and ``StoreLeases`` (kv_leases.py) talk
to the store through this protocol, as the worker's side talks through
``kvmesh.worker.kv_connector.KVBlockStore``: in a process it is the kvstore's gRPC
client (``kvmesh.kvstore.client.KVStoreClient``, which scheduler/server.py
constructs), in a test anything with these methods. Every method raises
``KVStoreError`` on any failure (unreachable, timed out, refused); the
callers count that as a miss (lookups) or leave the blocks to their lease TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvmesh.kvstore.client import Lease
from kvmesh.kvstore.layout import KVLayout


class SchedulerKVStore(Protocol):
    async def lookup_prefix(
        self,
        layouts: Sequence[KVLayout],
        block_hashes: Sequence[bytes],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """How many leading ``block_hashes`` are stored under every layout."""
        ...

    async def lease(
        self,
        layout: KVLayout,
        block_hashes: Sequence[bytes],
        ttl_s: float,
        *,
        timeout_s: float | None = None,
    ) -> Lease:
        """Pin the stored blocks of ``block_hashes`` under ``layout`` for ``ttl_s``."""
        ...

    async def release(self, lease_id: int, *, timeout_s: float | None = None) -> bool:
        """End a lease early; False if it had ended already."""
        ...
