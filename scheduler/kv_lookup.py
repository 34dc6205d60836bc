"""Ask the kvstore, off the step loop, how much of a new prompt it already holds.

The scheduler core does no I/O, so the KV connector's knowledge of the store
is fed from here: the scheduler service awaits ``lookup`` for each request
before queuing it (as it awaits grammar compilation), and hands the stored
prefix's hashes to ``KVConnectorScheduler.record_stored``. The answer is a
hint: the store may evict before the load, which then comes back short and
the request recomputes. A slow or dead store costs at most ``timeout_s`` per
request and counts as a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmesh.kvstore.client import KVStoreError
from kvmesh.kvstore.layout import KVLayout
from kvmesh.scheduler.kv_store import SchedulerKVStore
from kvmesh.services.contracts.block_hash import BlockHasher, extend_block_hashes

logger = logging.getLogger(__name__)

# A lookup moves no bytes (one small RPC on loopback or in the cluster); past
# this the store is treated as absent for this request.
DEFAULT_LOOKUP_TIMEOUT_S = 0.25


class StorePrefixLookup:
    def __init__(
        self,
        store: SchedulerKVStore,
        layouts: Sequence[KVLayout],
        block_size: int,
        hasher: BlockHasher,
        timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.layouts = list(layouts)
        self.block_size = block_size
        self.hasher = hasher
        self.timeout_s = timeout_s
        self._failing = False

    async def lookup(
        self, token_ids: Sequence[int], cache_salt: str | None, lora_id: str | None = None
    ) -> list[bytes] | None:
        """Hashes of the leading full blocks of ``token_ids`` that the store holds
        (under every layout); None when the store did not answer (a miss)."""
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size, cache_salt, self.hasher, lora_id)
        if not hashes:
            return []
        try:
            num_stored = await self.store.lookup_prefix(
                self.layouts, hashes, timeout_s=self.timeout_s
            )
        except KVStoreError as exc:
            if not self._failing:  # once per outage, not once per request
                logger.warning("kvstore lookup failed (treated as a miss): %s", exc)
            self._failing = True
            return None
        if self._failing:
            logger.info("kvstore lookups answer again")
            self._failing = False
        return hashes[:num_stored]
