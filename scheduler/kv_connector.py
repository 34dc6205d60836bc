"""The scheduler half of the KV connector: which blocks to load from, and save to, the kvstore.

The kvstore is the engine's second memory tier. Every full KV block is named by
the scheduler's chained prefix hash (``services/contracts/block_hash.py``), so a block
one replica saved is a block any replica with the same KV layout can load.
This half decides; the worker half (``worker/kv_connector.py``) moves bytes.
Both meet in the step contract: ``SchedulerOutput.kv_connector_metadata`` says
what to move, ``ModelRunnerOutput.kv_connector_output`` says what finished.

Contract with the scheduler (pure Python, no I/O, one thread):

- ``get_num_new_matched_tokens(request, num_local_computed_tokens)`` answers
  "how many tokens past the local prefix hits can be loaded?" from what this
  connector knows to be stored. It is side-effect free and may be called any
  number of times for the same request.
- ``update_state_after_alloc(request, block_ids, num_external_tokens)`` is
  called once the scheduler reserved blocks for those tokens; it plans the
  load. The request then waits in ``WAITING_FOR_REMOTE_KVS`` until
  ``ModelRunnerOutput.kv_connector_output.finished_loads`` names it.
- ``on_blocks_cached(request, block_ids, start, end)`` is called whenever
  blocks ``[start, end)`` of a request become full and computed; it plans
  their save (once per hash).
- ``build_connector_meta()`` hands everything planned since the previous call
  to the next step and forgets it.
- ``update_connector_output(output)`` digests what the worker reports.
- ``wait_for_saves(key, hashes)`` / ``pop_settled_save_waits()``: a caller
  that must know when some blocks are in the store (a prefill for another
  replica, ``scheduler/prefill.py``) waits until every one of them that is
  being saved was reported saved or failed. While such a wait is open the
  service keeps stepping (``has_pending_work``), since reports only travel
  with step results.

What the connector knows to be stored is a hint, not a promise: lookups
(``record_stored``, fed by the scheduler service from the store's
``LookupPrefix`` off the step loop), planned saves (optimistically) and saves
the worker confirmed. The store may evict at any time; a load that comes back
short only costs recomputation, and the hashes it missed are forgotten
(``finished_loads`` carries the number of leading blocks that arrived), so
the recomputed blocks are saved again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.scheduler.block_pool import KVCacheBlock
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.step import KVConnectorMetadata, KVConnectorOutput, KVTransfer

logger = logging.getLogger(__name__)

# Hashes remembered as stored: 1M hashes of 32 bytes cost ~150 MB of dict in
# CPython; 256k (~40 MB) covers ~4M tokens at 16 tokens per block.
DEFAULT_MAX_KNOWN_HASHES = 1 << 18


@dataclass(frozen=True)
class PendingLoad:
    """A load sent to the worker and not reported back yet."""

    num_local_computed_tokens: int
    block_hashes: tuple[bytes, ...]


@dataclass
class KVConnectorStats:
    """Counters since the previous ``make_stats()`` (scheduler metrics read them)."""

    block_size: int
    loads_started: int = 0
    blocks_requested: int = 0
    blocks_loaded: int = 0
    # Loads that came back short (some block missing, corrupt or unreachable).
    loads_short: int = 0
    blocks_saved_planned: int = 0
    blocks_saved_confirmed: int = 0
    failed_saves: int = 0


class KVConnectorScheduler:
    def __init__(self, block_size: int, max_known_hashes: int = DEFAULT_MAX_KNOWN_HASHES) -> None:
        if block_size <= 0 or max_known_hashes <= 0:
            raise ValueError("block_size and max_known_hashes must be positive")
        self.block_size = block_size
        self._max_known = max_known_hashes
        # Block hashes believed to be in the store, least recently seen first.
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._planned_loads: list[KVTransfer] = []
        self._planned_saves: list[KVTransfer] = []
        # req_id -> its load in flight (sent, not reported).
        self._loading: dict[str, PendingLoad] = {}
        # Hashes planned for saving and not reported saved or failed yet.
        self._saving: set[bytes] = set()
        # Open waits for saves: key -> the hashes it still waits for.
        self._save_waits: dict[str, set[bytes]] = {}
        self._settled_waits: list[str] = []
        self.stats = KVConnectorStats(block_size)

    # ---- what the store holds ----------------------------------------------

    def record_stored(self, block_hashes: Iterable[bytes]) -> None:
        """Remember hashes as stored (a lookup hit, a save, a load)."""
        stored = self._stored
        for block_hash in block_hashes:
            stored[block_hash] = None
            stored.move_to_end(block_hash)
        while len(stored) > self._max_known:
            stored.popitem(last=False)

    def forget(self, block_hashes: Iterable[bytes]) -> None:
        """Hashes the store turned out not to have (a short load)."""
        for block_hash in block_hashes:
            self._stored.pop(block_hash, None)

    def num_stored_prefix_blocks(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """Leading blocks of ``block_hashes[start:]`` believed stored."""
        stored = self._stored
        count = 0
        for block_hash in block_hashes[start:]:
            if block_hash not in stored:
                break
            count += 1
        return count

    # ---- loads -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_local_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens after the local hits that the store can supply, and whether
        the load is asynchronous (always: it never blocks a step).

        Only full blocks of the prompt-plus-output already hashed count
        (``request.block_hashes``; the caller hashes them before asking, as
        the local prefix lookup does). The load may cover every full block,
        the last one included: the re-admitted request then finds them as
        local hits, and the local cap of ``num_tokens - 1`` recomputes the
        tail to get logits.
        """
        if num_local_computed_tokens % self.block_size:
            return 0, False  # local hits always end on a block boundary
        start = num_local_computed_tokens // self.block_size
        num_blocks = self.num_stored_prefix_blocks(request.block_hashes, start)
        # Loading the only block that local caching would skip anyway buys
        # nothing: re-admission recomputes it (its last token needs logits).
        max_useful = (request.num_tokens - 1) // self.block_size - start
        num_blocks = min(num_blocks, max(max_useful, 0))
        return num_blocks * self.block_size, num_blocks > 0

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: Sequence[int],
        num_local_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Plan the load of ``num_external_tokens`` (after the local hits) into
        ``block_ids``, which the scheduler just reserved for the request."""
        num_blocks = num_external_tokens // self.block_size
        if num_blocks != len(block_ids) or num_external_tokens % self.block_size:
            raise ValueError(f"{num_external_tokens} tokens to load into {len(block_ids)} blocks")
        start = num_local_computed_tokens // self.block_size
        hashes = tuple(request.block_hashes[start : start + num_blocks])
        self._loading[request.request_id] = PendingLoad(num_local_computed_tokens, hashes)
        self._planned_loads.append(KVTransfer(request.request_id, list(block_ids), list(hashes)))
        self.stats.loads_started += 1
        self.stats.blocks_requested += num_blocks

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def finish_load(self, request_id: str, num_loaded_blocks: int) -> PendingLoad | None:
        """The worker reported a load; returns it (None if unknown), forgets missed hashes."""
        load = self._loading.pop(request_id, None)
        if load is None:
            return None
        num_loaded_blocks = max(0, min(num_loaded_blocks, len(load.block_hashes)))
        self.stats.blocks_loaded += num_loaded_blocks
        if num_loaded_blocks < len(load.block_hashes):
            self.stats.loads_short += 1
            # The first missing block was not there (or not intact) and what
            # follows is unproven: forget them all, so that recomputing them
            # saves them again and the store heals.
            self.forget(load.block_hashes[num_loaded_blocks:])
            logger.info(
                "request %s: loaded %s of %s blocks from the store; recomputing the rest",
                request_id,
                num_loaded_blocks,
                len(load.block_hashes),
            )
        self.record_stored(load.block_hashes[:num_loaded_blocks])
        return load

    def cancel_load(self, request_id: str) -> None:
        """Forget a request's load, planned or sent (its request was aborted).

        The scheduler lists the request in the next step's ``finished_req_ids``;
        the worker drops its load before writing anything of that step, so the
        blocks may be handed to another request in that very step. A report
        that still comes for it is ignored (``finish_load`` returns None).
        """
        self._planned_loads = [t for t in self._planned_loads if t.req_id != request_id]
        self._loading.pop(request_id, None)

    def reset(self) -> list[str]:
        """Forget loads and saves in flight (the worker that ran them is gone);
        returns the ids of the loads. Every open wait for saves is settled: what
        reached the store is there, the rest never will be."""
        ids = list(self._loading)
        self._loading.clear()
        self._planned_loads.clear()
        self._planned_saves.clear()
        self._saving.clear()
        self._settled_waits.extend(self._save_waits)
        self._save_waits.clear()
        return ids

    # ---- saves -------------------------------------------------------------

    def on_blocks_cached(
        self, request: Request, blocks: Sequence[KVCacheBlock], start: int, end: int
    ) -> None:
        """Blocks ``[start, end)`` of ``request`` are full and computed: save the
        ones the store is not known to hold (``KVCacheManager``'s hook)."""
        hashes = request.block_hashes
        stored = self._stored
        save_ids: list[int] = []
        save_hashes: list[bytes] = []
        for index in range(start, end):
            block_hash = hashes[index]
            if block_hash in stored:
                continue
            save_ids.append(blocks[index].block_id)
            save_hashes.append(block_hash)
        if save_ids:
            self._planned_saves.append(KVTransfer(request.request_id, save_ids, save_hashes))
            self._saving.update(save_hashes)
            self.stats.blocks_saved_planned += len(save_ids)
            # Optimistic: a save that fails shows up as a short load later.
            self.record_stored(save_hashes)

    # ---- per step ----------------------------------------------------------

    def wait_for_saves(self, key: str, block_hashes: Iterable[bytes]) -> bool:
        """Open a wait, named ``key``, for the saves of ``block_hashes`` in flight.

        True when none is in flight (nothing to wait for: the wait is not
        opened). Otherwise ``pop_settled_save_waits`` returns ``key`` once each
        of them was reported saved or failed. Hashes not being saved count as
        settled: either known stored (a lookup, an earlier save) or never
        planned, and only the store can tell which (a lease answers that).
        """
        pending = self._saving.intersection(block_hashes)
        if not pending:
            return True
        self._save_waits[key] = pending
        return False

    def cancel_save_wait(self, key: str) -> None:
        """Drop an open wait (its caller went away)."""
        self._save_waits.pop(key, None)

    def pop_settled_save_waits(self) -> list[str]:
        """Keys of the waits settled since the previous call."""
        settled, self._settled_waits = self._settled_waits, []
        return settled

    def _settle_saves(self, block_hashes: list[bytes]) -> None:
        self._saving.difference_update(block_hashes)
        for key, pending in list(self._save_waits.items()):
            pending.difference_update(block_hashes)
            if not pending:
                del self._save_waits[key]
                self._settled_waits.append(key)

    def has_pending_work(self) -> bool:
        """Whether a step must be sent even with no tokens scheduled: something is
        planned, a load is in flight and its completion must be collected, or
        someone waits for saves, whose reports come back with step results."""
        return bool(self._planned_loads or self._planned_saves or self._loading or self._save_waits)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._planned_loads, saves=self._planned_saves)
        self._planned_loads = []
        self._planned_saves = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Saves the worker confirmed or failed (loads go through ``finish_load``)."""
        saved, failed = output.saved_block_hashes, output.failed_save_hashes
        if saved:
            self.stats.blocks_saved_confirmed += len(saved)
            self.record_stored(saved)
        if failed:
            self.stats.failed_saves += len(failed)
            # Recorded optimistically when planned; forgotten, a block cached
            # again is saved again.
            self.forget(failed)
        if self._saving and (saved or failed):
            self._settle_saves(saved + failed)

    def make_stats(self) -> KVConnectorStats:
        stats, self.stats = self.stats, KVConnectorStats(self.block_size)
        return stats
