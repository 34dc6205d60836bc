"""kvstore leases that keep a prefilled prompt's blocks for the decode replica.

Prefill/decode disaggregation hands KV from one replica to another through the
kvstore. Between the prefill replica's last save and the decode replica's load
the blocks must not be evicted, so the prefill side leases them
(``StoreLeases.lease``) and the decode side ends the leases once its request
has run (``HeldLeases``). A lease also ends on its own after its TTL, so a
decode that never comes (the client went away, the decode replica refused or
died) pins nothing for long. Like every kvstore call, a failed lease or
release is never an error for the request: it only costs recomputation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence

from kvmesh.kvstore.client import KVStoreError
from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.kv_store import SchedulerKVStore
from kvmesh.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Lease and release are one small RPC each, off the step loop.
DEFAULT_LEASE_TIMEOUT_S = 1.0


def num_leading(flags: Sequence[bool]) -> int:
    """How many leading entries of ``flags`` are true."""
    for index, flag in enumerate(flags):
        if not flag:
            return index
    return len(flags)


class StoreLeases:
    """Leases on blocks under every KV layout of one worker (one per TP rank)."""

    def __init__(
        self,
        store: SchedulerKVStore,
        layouts: Sequence[KVLayout],
        ttl_s: float,
        timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("lease ttl must be positive")
        self.store = store
        self.layouts = list(layouts)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        # Fire-and-forget releases, referenced until done.
        self._releases: set[asyncio.Task[None]] = set()

    async def lease(self, block_hashes: Sequence[bytes]) -> tuple[list[int], int]:
        """Pin ``block_hashes`` for ``ttl_s``: (lease ids, leading blocks pinned under
        every layout). ([], 0) when nothing usable is pinned; no lease is left
        behind then, except one granted while the caller was cancelled (its TTL
        ends it)."""
        if not block_hashes:
            return [], 0
        lease_ids: list[int] = []
        num_blocks = len(block_hashes)
        try:
            for layout in self.layouts:
                lease = await self.store.lease(
                    layout, block_hashes, self.ttl_s, timeout_s=self.timeout_s
                )
                lease_ids.append(lease.lease_id)
                num_blocks = min(num_blocks, num_leading(lease.leased))
        except KVStoreError as exc:
            logger.warning("kvstore lease failed (the decode side recomputes): %s", exc)
            num_blocks = 0
        except asyncio.CancelledError:
            self.release_soon(lease_ids)
            raise
        if num_blocks == 0:
            self.release_soon(lease_ids)
            return [], 0
        return lease_ids, num_blocks

    def release_soon(self, lease_ids: Sequence[int]) -> None:
        """End leases in the background; a failure leaves them to their TTL."""
        if lease_ids:
            task = asyncio.get_running_loop().create_task(self._release(list(lease_ids)))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, lease_ids: list[int]) -> None:
        for lease_id in lease_ids:
            try:
                await self.store.release(lease_id, timeout_s=self.timeout_s)
            except KVStoreError as exc:
                logger.info("kvstore lease %d not released (its TTL ends it): %s", lease_id, exc)

    async def drain(self) -> None:
        """Wait for the releases in flight (shutdown, tests)."""
        while self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)


class HeldLeases:
    """Decode side: the leases a transferred request's blocks arrived under,
    held until the request has run.

    A request's leases end once it is admitted to the running batch (its KV
    was loaded and is now its own, or was never needed: a local prefix hit,
    a short load), or once it ended (aborted, failed) before that. While it
    waits in the queue or for its load the blocks stay pinned.
    """

    def __init__(self, leases: StoreLeases | None) -> None:
        self.leases = leases
        self._held: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def held_for(self, msg: scheduler_pb2.AddRequestRequest) -> Iterator[None]:
        """Around the admission of ``msg``: once it is queued, hold the leases its
        transfer brought; if it is refused (or the call is cancelled), end them
        now, since nobody else will."""
        lease_ids = list(msg.kv_transfer.lease_ids) if msg.HasField("kv_transfer") else []
        if not lease_ids or self.leases is None:
            yield  # nothing to hold, or no store to release them in: their TTL ends them
            return
        try:
            yield
        except BaseException:
            self.leases.release_soon(lease_ids)
            raise
        self._held[msg.request_id] = lease_ids

    def release_settled(self, core: Scheduler) -> None:
        """End the leases of requests that ran or ended (called after each step)."""
        if not self._held:
            return
        for request_id in list(self._held):
            request = core.get_request(request_id)
            if request is None or request.first_scheduled_time is not None:
                assert self.leases is not None
                self.leases.release_soon(self._held.pop(request_id))

    @property
    def num_held(self) -> int:
        return len(self._held)
