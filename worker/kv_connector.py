"""Worker side of the KV connector: the kvstore as the paged cache's second tier.

Two threads share the work. The step thread (the worker's one torch thread)
calls ``start_step`` at the start of every ``execute_model``, in this order:

1. snapshot this step's ``saves`` (copy the blocks out of the cache) and hand
   the bytes to the event loop for a background put. The snapshot comes first
   because the scheduler may have freed such a block and handed it to another
   request that this very step loads or computes into;
2. write every load whose bytes have arrived into its reserved blocks (the
   leading intact blocks only) and note ``finished_loads[req_id] = n``;
3. start fetches for this step's ``loads`` on the loop. A step never waits
   for the store: a fetch is applied by whichever step starts after it ends.

The event loop (which also runs gRPC) talks to the store and hands arrived
loads back through a thread-safe queue. ``get_finished`` drains what finished
into the step's ``KVConnectorOutput``. Store errors, timeouts and corrupt
blocks never fail a step: a load stops at its first bad block, a failed save is
reported by hash, and each kind of failure is logged once (then only counted).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from kvmesh.services.contracts.step import KVConnectorOutput, KVTransfer, SchedulerOutput
from kvmesh.worker.kv_cache import KVCache
from kvmesh.worker.kv_layout import KVBlockCodec

logger = logging.getLogger(__name__)

# Beyond this many bytes of snapshots waiting for the store, new saves are
# dropped (and counted): a slow store must not grow the worker's memory.
DEFAULT_MAX_INFLIGHT_SAVE_BYTES = 256 * 1024 * 1024

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LOADED_BLOCKS = Counter(
    "kvmesh:kv_connector_loaded_blocks_total", "KV blocks loaded from the kvstore into the cache"
)
_LOAD_FAILURES = Counter(
    "kvmesh:kv_connector_load_failures_total",
    "KV blocks asked for but not loaded, by why their load stopped",
    ["reason"],
)
_SAVED_BLOCKS = Counter("kvmesh:kv_connector_saved_blocks_total", "KV blocks the kvstore committed")
_SAVE_FAILURES = Counter(
    "kvmesh:kv_connector_save_failures_total",
    "KV blocks not saved (store error, timeout, refused, dropped for backpressure)",
    ["reason"],
)
_LOAD_SECONDS = Histogram(
    "kvmesh:kv_connector_load_seconds",
    "time to fetch one request's blocks from the kvstore",
    buckets=_LATENCY_BUCKETS,
)
_SAVE_SECONDS = Histogram(
    "kvmesh:kv_connector_save_seconds",
    "time to put one step's snapshot into the kvstore",
    buckets=_LATENCY_BUCKETS,
)


class KVBlockStore(Protocol):
    """The async store the connector needs, bound to this worker's KV layout
    (``worker/kvstore_blocks.py`` over the kvstore's client); called on the
    event loop only."""

    async def get_blocks(self, hashes: list[bytes]) -> list[bytes | None]:
        """Each block's bytes in request order, None where the store has none."""
        ...

    async def put_blocks(self, hashes: list[bytes], datas: list[bytes]) -> list[bool]:
        """Store each block; per block, whether the store committed it."""
        ...


@dataclass
class _PendingLoad:
    """A load whose fetch is running; cancelled when its request is dropped."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    cancelled: bool = False


@dataclass
class _ArrivedLoad:
    load: _PendingLoad
    datas: list[bytes | None]
    # Why nothing came back ("timeout", "store_error"), None if the store answered.
    error: str | None = None
    # What went wrong, for the log (the exception).
    detail: str = ""


def leading_intact_blocks(
    datas: list[bytes | None], num_asked: int, block_bytes: int
) -> tuple[int, str | None]:
    """(how many leading blocks are usable, why the next one is not).

    A block is usable when present and exactly ``block_bytes`` long; any other
    length means corrupt. Blocks after the first bad one are never used: a
    block's KV is only valid after the whole prefix before it.
    """
    for index in range(num_asked):
        data = datas[index] if index < len(datas) else None
        if data is None:
            return index, "missing"
        if len(data) != block_bytes:
            return index, "corrupt"
    return num_asked, None


class KVConnectorWorker:
    """Moves KV blocks between one worker's paged cache and the kvstore.

    ``start_step``, ``get_finished`` and ``reset`` belong to the step thread;
    the store is only ever called on ``loop``. State crossing the two lives
    behind ``_lock`` (save results) or in ``_arrived`` (fetch results).
    """

    def __init__(
        self,
        kv_caches: list[KVCache],
        store: KVBlockStore,
        loop: asyncio.AbstractEventLoop,
        max_inflight_save_bytes: int = DEFAULT_MAX_INFLIGHT_SAVE_BYTES,
        load_timeout_s: float = 5.0,
        save_timeout_s: float = 30.0,
    ) -> None:
        self.codec = KVBlockCodec(kv_caches)
        self.store = store
        self.loop = loop
        self.max_inflight_save_bytes = max_inflight_save_bytes
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        # Step thread only.
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._finished_loads: dict[str, int] = {}
        # Filled on the loop, drained by the step thread.
        self._arrived: queue.SimpleQueue[_ArrivedLoad] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._saved_hashes: list[bytes] = []
        self._failed_hashes: list[bytes] = []
        self._inflight_save_bytes = 0
        # Loop only: running store calls (strong references, and what drain() awaits).
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged_failures: set[str] = set()

    @property
    def block_bytes(self) -> int:
        return self.codec.block_bytes

    @property
    def inflight_save_bytes(self) -> int:
        with self._lock:
            return self._inflight_save_bytes

    # ---- step thread ------------------------------------------------------

    def start_step(self, scheduler_output: SchedulerOutput) -> None:
        """Snapshot saves, apply arrived loads, start new fetches (see module doc)."""
        meta = scheduler_output.kv_connector_metadata
        # A dropped request's blocks may be reused by this very step: its load
        # must never be written.
        for req_id in scheduler_output.finished_req_ids:
            self._cancel_load(req_id)
        if meta.saves:
            self._snapshot_saves(meta.saves)
        self._apply_arrived_loads()
        for transfer in meta.loads:
            self._start_load(transfer)

    def get_finished(self) -> KVConnectorOutput:
        """What finished since the last call: loads applied, saves committed or failed."""
        finished_loads, self._finished_loads = self._finished_loads, {}
        with self._lock:
            saved, self._saved_hashes = self._saved_hashes, []
            failed, self._failed_hashes = self._failed_hashes, []
        return KVConnectorOutput(
            finished_loads=finished_loads, saved_block_hashes=saved, failed_save_hashes=failed
        )

    def reset(self) -> None:
        """Forget every load (a new scheduler attaches and reuses all blocks)."""
        for req_id in list(self._pending_loads):
            self._cancel_load(req_id)
        self._finished_loads.clear()

    def _cancel_load(self, req_id: str) -> None:
        load = self._pending_loads.pop(req_id, None)
        if load is not None:
            load.cancelled = True
            logger.debug("request %s: KV load cancelled (request dropped)", req_id)

    def _is_valid(self, transfer: KVTransfer) -> bool:
        if len(transfer.block_ids) == len(transfer.block_hashes) and all(
            0 <= block_id < self.codec.num_blocks for block_id in transfer.block_ids
        ):
            return True
        self._log_failure(
            "transfer:invalid",
            "request %s: KV transfer with bad block ids or hashes ignored",
            transfer.req_id,
        )
        return False

    def _snapshot_saves(self, transfers: list[KVTransfer]) -> None:
        block_ids: list[int] = []
        hashes: list[bytes] = []
        seen: set[bytes] = set()
        invalid: list[bytes] = []
        for transfer in transfers:
            if not self._is_valid(transfer):
                invalid.extend(transfer.block_hashes)
                continue
            for block_id, block_hash in zip(transfer.block_ids, transfer.block_hashes, strict=True):
                if block_hash not in seen:
                    seen.add(block_hash)
                    block_ids.append(block_id)
                    hashes.append(block_hash)
        with self._lock:
            room = self.max_inflight_save_bytes - self._inflight_save_bytes
            num_taken = min(len(hashes), max(room, 0) // self.block_bytes)
            self._inflight_save_bytes += num_taken * self.block_bytes
            self._failed_hashes.extend(invalid)
            self._failed_hashes.extend(hashes[num_taken:])
        self._count_save_failures("invalid", len(invalid))
        if num_taken < len(hashes):
            self._count_save_failures("backpressure", len(hashes) - num_taken)
            self._log_failure(
                "save:backpressure",
                "KV saves dropped: %d bytes already waiting for the kvstore",
                self.max_inflight_save_bytes - room,
            )
        if num_taken == 0:
            return
        datas = self.codec.read_blocks(block_ids[:num_taken])
        put = self._put(hashes[:num_taken], datas)
        if not self._submit(put):
            self._finish_put(hashes[:num_taken], [False] * num_taken, "loop_closed", "no loop")

    def _apply_arrived_loads(self) -> None:
        block_ids: list[int] = []
        datas: list[bytes] = []
        while True:
            try:
                arrived = self._arrived.get_nowait()
            except queue.Empty:
                break
            load = arrived.load
            if load.cancelled:
                continue
            del self._pending_loads[load.req_id]
            num_asked = len(load.block_hashes)
            if arrived.error is not None:
                num_loaded, reason = 0, arrived.error
            else:
                num_loaded, reason = leading_intact_blocks(
                    arrived.datas, num_asked, self.block_bytes
                )
            block_ids.extend(load.block_ids[:num_loaded])
            datas.extend(arrived.datas[:num_loaded])  # type: ignore[arg-type]
            self._finished_loads[load.req_id] = num_loaded
            _LOADED_BLOCKS.inc(num_loaded)
            if reason is not None:
                _LOAD_FAILURES.labels(reason).inc(num_asked - num_loaded)
                self._log_failure(
                    f"load:{reason}",
                    "request %s: KV load stopped at block %d of %d: %s",
                    load.req_id,
                    num_loaded,
                    num_asked,
                    arrived.detail or reason,
                )
        self.codec.write_blocks(block_ids, datas)

    def _start_load(self, transfer: KVTransfer) -> None:
        self._cancel_load(transfer.req_id)
        if not self._is_valid(transfer):
            self._finished_loads[transfer.req_id] = 0
            _LOAD_FAILURES.labels("invalid").inc(len(transfer.block_ids))
            return
        load = _PendingLoad(transfer.req_id, list(transfer.block_ids), list(transfer.block_hashes))
        self._pending_loads[load.req_id] = load
        if not self._submit(self._fetch(load)):
            self._arrived.put(_ArrivedLoad(load, [], "loop_closed", "no loop"))

    def _submit(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run ``coro`` as a task on the loop; False if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self._spawn, coro)
        except RuntimeError:
            coro.close()
            return False
        return True

    # ---- event loop -------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait until every started fetch and put has finished (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _fetch(self, load: _PendingLoad) -> None:
        started = time.perf_counter()
        try:
            datas = await asyncio.wait_for(
                self.store.get_blocks(load.block_hashes), self.load_timeout_s
            )
            arrived = _ArrivedLoad(load, datas)
        except TimeoutError:
            arrived = _ArrivedLoad(load, [], "timeout", f"no answer in {self.load_timeout_s}s")
        except Exception as exc:
            arrived = _ArrivedLoad(load, [], "store_error", f"{type(exc).__name__}: {exc}")
        _LOAD_SECONDS.observe(time.perf_counter() - started)
        self._arrived.put(arrived)

    async def _put(self, hashes: list[bytes], datas: list[bytes]) -> None:
        started = time.perf_counter()
        none_stored = [False] * len(hashes)
        reason, detail = "refused", "the store refused them"
        try:
            stored = await asyncio.wait_for(
                self.store.put_blocks(hashes, datas), self.save_timeout_s
            )
            if len(stored) != len(hashes):
                reason, detail = "bad_reply", f"{len(stored)} answers for {len(hashes)} blocks"
                stored = none_stored
        except TimeoutError:
            reason, detail = "timeout", f"no answer in {self.save_timeout_s}s"
            stored = none_stored
        except Exception as exc:
            reason, detail, stored = "store_error", f"{type(exc).__name__}: {exc}", none_stored
        _SAVE_SECONDS.observe(time.perf_counter() - started)
        self._finish_put(hashes, stored, reason, detail)

    def _finish_put(
        self, hashes: list[bytes], stored: list[bool], reason: str, detail: str
    ) -> None:
        saved = [block_hash for block_hash, ok in zip(hashes, stored, strict=True) if ok]
        failed = [block_hash for block_hash, ok in zip(hashes, stored, strict=True) if not ok]
        num_failed = len(failed)
        with self._lock:
            self._inflight_save_bytes -= len(hashes) * self.block_bytes
            self._saved_hashes.extend(saved)
            self._failed_hashes.extend(failed)
        _SAVED_BLOCKS.inc(len(saved))
        if num_failed:
            self._count_save_failures(reason, num_failed)
            self._log_failure(f"save:{reason}", "%d KV blocks not saved: %s", num_failed, detail)

    # ---- both threads -----------------------------------------------------

    @staticmethod
    def _count_save_failures(reason: str, num_blocks: int) -> None:
        if num_blocks:
            _SAVE_FAILURES.labels(reason).inc(num_blocks)

    def _log_failure(self, kind: str, message: str, *args: object) -> None:
        """Warn the first time a kind of failure happens; later ones are only counted."""
        if kind in self._logged_failures:
            logger.debug(message, *args)
            return
        self._logged_failures.add(kind)
        logger.warning(message + " (further %s failures are only counted)", *args, kind)
