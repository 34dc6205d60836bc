"""The KVEvents gRPC service: a scheduler's prefix-cache events, streamed to routers.

``KVEventPublisher`` is the block pool's event sink in a running scheduler. It
records into a ``KVEventLog`` and seals the batch with ``loop.call_soon`` at
the first event: the scheduler's state changes only in synchronous runs of
its one event loop (a ``schedule()`` or an ``update_from_output()``), so one
batch holds the events of one such run, and no batch ever waits for a step
that may not come. Each sealed batch goes to every subscriber's queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass

from kvmesh.protos import scheduler_pb2, scheduler_pb2_grpc
from kvmesh.scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventLog,
)
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.block_hash import BlockHash
from kvmesh.services.contracts.errors import OverloadedError

logger = logging.getLogger(__name__)

# Batches queued for one subscriber before it is considered stuck and dropped.
MAX_SUBSCRIBER_BACKLOG = 10_000
# How often an idle stream checks whether the load changed (a load report).
LOAD_REPORT_INTERVAL_S = 0.05
# An idle stream reports at least this often, changed or not: the report
# carries the last sequence, so a subscriber that missed the last batches
# learns it even when no batch follows them.
HEARTBEAT_INTERVAL_S = 1.0

# Ends a dropped subscriber's stream.
_DROPPED = None
# One subscriber's live batches (or _DROPPED).
BatchQueue = asyncio.Queue[scheduler_pb2.KVEventBatch | None]


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy the replica is: the scheduler's queues and KV pool, now."""

    num_running: int
    num_waiting: int
    num_active_blocks: int
    num_kv_blocks: int
    num_waiting_blocks: int = 0

    def to_proto(self) -> scheduler_pb2.ReplicaLoad:
        return scheduler_pb2.ReplicaLoad(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_active_blocks=self.num_active_blocks,
            num_kv_blocks=self.num_kv_blocks,
            num_waiting_blocks=self.num_waiting_blocks,
        )


def event_to_proto(event: KVCacheEvent, block_size: int) -> scheduler_pb2.KVCacheEvent:
    if isinstance(event, BlockStored):
        stored = scheduler_pb2.BlockStored(block_hashes=event.block_hashes, block_size=block_size)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return scheduler_pb2.KVCacheEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        removed = scheduler_pb2.BlockRemoved(block_hashes=event.block_hashes)
        return scheduler_pb2.KVCacheEvent(removed=removed)
    if isinstance(event, AllBlocksCleared):
        return scheduler_pb2.KVCacheEvent(all_cleared=scheduler_pb2.AllBlocksCleared())
    raise TypeError(f"not a KV cache event: {event!r}")


def batch_to_proto(
    batch: KVEventBatch, instance_id: int, block_size: int, load: ReplicaLoad
) -> scheduler_pb2.KVEventBatch:
    return scheduler_pb2.KVEventBatch(
        instance_id=instance_id,
        sequence=batch.sequence,
        resync=batch.resync,
        events=[event_to_proto(event, block_size) for event in batch.events],
        load=load.to_proto(),
        timestamp=batch.timestamp,
    )


def load_report(log: KVEventLog, load: ReplicaLoad) -> scheduler_pb2.KVEventBatch:
    """A batch without events: ``load`` now, after the log's last sealed batch."""
    return scheduler_pb2.KVEventBatch(
        instance_id=log.instance_id, sequence=log.last_sequence, load=load.to_proto()
    )


class KVEventPublisher:
    """Seals a scheduler's KV events once per loop turn and fans them out.

    ``record`` is the sink to hand the block pool; it must be called on the
    event loop that serves the stream. ``read_load`` and
    ``cached_block_hashes`` read the scheduler (its queues, its prefix-cache
    map) on that loop too.
    """

    def __init__(
        self,
        log: KVEventLog,
        block_size: int,
        read_load: Callable[[], ReplicaLoad],
        cached_block_hashes: Callable[[], Collection[BlockHash]],
    ) -> None:
        self.log = log
        self.block_size = block_size
        self.read_load = read_load
        self.cached_block_hashes = cached_block_hashes
        self._seal_scheduled = False
        self._subscribers: dict[int, BatchQueue] = {}

    def record(self, event: KVCacheEvent) -> None:
        self.log.record(event)
        if not self._seal_scheduled:
            self._seal_scheduled = True
            asyncio.get_running_loop().call_soon(self.seal)

    def seal(self) -> None:
        """Close the current batch and queue it for every subscriber."""
        self._seal_scheduled = False
        batch = self.log.seal()
        if batch is None or not self._subscribers:
            return  # kept for replay all the same
        message = self.to_proto(batch)
        for key, queue in list(self._subscribers.items()):
            if queue.qsize() >= MAX_SUBSCRIBER_BACKLOG:
                logger.error(
                    "KV event subscriber %s is %d batches behind; dropping it", key, queue.qsize()
                )
                del self._subscribers[key]
                queue.put_nowait(_DROPPED)
                continue
            queue.put_nowait(message)

    def to_proto(self, batch: KVEventBatch) -> scheduler_pb2.KVEventBatch:
        return batch_to_proto(batch, self.log.instance_id, self.block_size, self.read_load())

    def subscribe(
        self, from_sequence: int, instance_id: int
    ) -> tuple[int, list[scheduler_pb2.KVEventBatch], BatchQueue]:
        """Catch-up batches and the queue of live ones, with nothing lost or
        repeated between them (no await separates the two)."""
        self.seal()
        catch_up = self.log.catch_up(from_sequence, instance_id, self.cached_block_hashes)
        queue: BatchQueue = asyncio.Queue()
        key = id(queue)
        self._subscribers[key] = queue
        return key, [self.to_proto(batch) for batch in catch_up], queue

    def unsubscribe(self, key: int) -> None:
        self._subscribers.pop(key, None)

    def load_report(self) -> scheduler_pb2.KVEventBatch:
        return load_report(self.log, self.read_load())


def attach_publisher(scheduler: Scheduler, log: KVEventLog | None = None) -> KVEventPublisher:
    """A publisher of ``scheduler``'s KV events, installed as its block pool's sink.

    Attached to a built scheduler because the two refer to each other (the
    publisher reads the scheduler's queues); do it before the first request,
    so that no cached block goes unreported.
    """
    pool = scheduler.kv_cache_manager.block_pool
    if pool.event_sink is not None or pool.cached_block_hash_to_block:
        raise RuntimeError("attach the KV event publisher to a fresh scheduler, once")

    def read_load() -> ReplicaLoad:
        return ReplicaLoad(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_active_blocks=pool.num_blocks - pool.get_num_free_blocks(),
            num_kv_blocks=pool.num_blocks,
            num_waiting_blocks=scheduler.num_waiting_blocks(),
        )

    publisher = KVEventPublisher(
        log if log is not None else KVEventLog(),
        scheduler.config.block_size,
        read_load,
        pool.cached_block_hash_to_block.keys,
    )
    pool.event_sink = publisher.record
    return publisher


class KVEventsServicer(scheduler_pb2_grpc.KVEventsServicer):
    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    async def StreamKVEvents(
        self, request: scheduler_pb2.StreamKVEventsRequest, context: object
    ) -> AsyncIterator[scheduler_pb2.KVEventBatch]:
        publisher = self.publisher
        key, catch_up, queue = publisher.subscribe(request.from_sequence, request.instance_id)
        logger.info(
            "KV event subscriber %r attached from sequence %d (%s)",
            request.subscriber,
            request.from_sequence,
            "resync" if catch_up and catch_up[0].resync else f"{len(catch_up)} batches replayed",
        )
        last_load = None
        last_sent = time.monotonic()
        try:
            for message in catch_up:
                last_load = message.load
                yield message
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), LOAD_REPORT_INTERVAL_S)
                except TimeoutError:
                    # Every sealed batch was sent: a report may follow them.
                    message = publisher.load_report()
                    quiet_s = time.monotonic() - last_sent
                    if message.load == last_load and quiet_s < HEARTBEAT_INTERVAL_S:
                        continue
                if message is _DROPPED:
                    raise OverloadedError(
                        f"fell {MAX_SUBSCRIBER_BACKLOG} KV event batches behind; "
                        "reconnect from the last sequence applied"
                    )
                last_load = message.load
                last_sent = time.monotonic()
                yield message
        finally:
            publisher.unsubscribe(key)
            logger.info("KV event subscriber %r detached", request.subscriber)
