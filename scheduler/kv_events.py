"""KV cache events of one replica: what entered and left its prefix cache, in order.

The block pool reports every change of its prefix cache to an event sink (a
block stored under its hash, a cached block evicted, the whole cache reset).
``KVEventLog`` is that sink: it gathers the events of one engine step and
seals them into a ``KVEventBatch`` with the next sequence number, so a router
that applies every batch in order knows exactly which prefixes the replica
holds.

Sequence numbers count batches from 1 within one log (one scheduler process:
``instance_id`` names it, so a subscriber notices a restart). The log keeps
the latest batches, up to ``max_replay_blocks`` block hashes in all, for
subscribers that reconnect: ``catch_up`` answers with exactly the batches
missed, or, when some of them are gone (or the subscriber never saw this
instance), with a resync, a snapshot of every cached block after a clear. A
router that fell far behind thus pays one snapshot, never a wrong index.

Pure: no asyncio, no gRPC. ``kvmesh.scheduler.kv_events_service`` seals batches on
the event loop and streams them.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvmesh.services.contracts.block_hash import BlockHash

# How many block hashes one resync batch carries: a snapshot of 100k blocks
# goes out as a few messages of ~130 KiB rather than one of several MiB.
RESYNC_BLOCKS_PER_BATCH = 4096


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered the prefix cache: consecutive blocks of one sequence,
    each the child of the one before; the first one's parent is
    ``parent_block_hash`` (None: the sequence's first block, or unknown in a
    resync snapshot, whose blocks come in no particular order)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks whose KV was overwritten (evicted): their hashes no longer hit."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was forgotten (reset, or the worker was lost)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
# What the block pool calls with each change of its prefix cache.
KVEventSink = Callable[[KVCacheEvent], None]


def num_event_blocks(event: KVCacheEvent) -> int:
    """An event's weight in the replay buffer: its hashes (a clear weighs one)."""
    return 1 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one step, or one part of a resync snapshot.

    ``sequence``: 1, 2, 3... for the batches of one log. A resync batch
    carries the sequence of the last batch its snapshot includes (0 if none);
    every part of one snapshot carries the same number and the first part
    begins with ``AllBlocksCleared``.
    """

    sequence: int
    events: tuple[KVCacheEvent, ...]
    timestamp: float
    resync: bool = False


def make_resync_batches(
    sequence: int,
    cached_block_hashes: Collection[BlockHash],
    timestamp: float,
    blocks_per_batch: int = RESYNC_BLOCKS_PER_BATCH,
) -> list[KVEventBatch]:
    """A snapshot answer: clear, then every cached block, in batches of bounded size."""
    hashes = tuple(cached_block_hashes)
    first: list[KVCacheEvent] = [AllBlocksCleared()]
    chunks = [hashes[i : i + blocks_per_batch] for i in range(0, len(hashes), blocks_per_batch)]
    batches = []
    for index, chunk in enumerate(chunks or [()]):
        events = [BlockStored(chunk, None)] if chunk else []
        if index == 0:
            events = first + events
        batches.append(KVEventBatch(sequence, tuple(events), timestamp, resync=True))
    return batches


class KVEventLog:
    """One replica's event history: the current step's events and a bounded replay buffer.

    Contract: ``record`` is the block pool's sink; ``seal`` closes the current
    batch (the caller does so once per step); ``catch_up`` tells a
    (re)connecting subscriber what to apply before the next sealed batch. The
    buffer keeps whole batches, newest first to stay, until they hold more
    than ``max_replay_blocks`` hashes (the newest batch always stays).
    """

    def __init__(
        self,
        max_replay_blocks: int = 1 << 18,
        clock: Callable[[], float] = time.time,
        instance_id: int | None = None,
    ) -> None:
        if max_replay_blocks <= 0:
            raise ValueError(f"max_replay_blocks must be positive, got {max_replay_blocks}")
        self.max_replay_blocks = max_replay_blocks
        self.clock = clock
        # Random and non-zero: 0 is what a subscriber that saw nothing sends.
        self.instance_id = instance_id if instance_id is not None else secrets.randbits(63) | 1
        self.last_sequence = 0
        self._pending: list[KVCacheEvent] = []
        self._replay: deque[KVEventBatch] = deque()
        self._replay_blocks = 0

    def record(self, event: KVCacheEvent) -> None:
        self._pending.append(event)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def seal(self) -> KVEventBatch | None:
        """Close the current batch (None when no event was recorded since the last)."""
        if not self._pending:
            return None
        self.last_sequence += 1
        batch = KVEventBatch(self.last_sequence, tuple(self._pending), self.clock())
        self._pending = []
        self._replay.append(batch)
        self._replay_blocks += sum(num_event_blocks(e) for e in batch.events)
        while self._replay_blocks > self.max_replay_blocks and len(self._replay) > 1:
            dropped = self._replay.popleft()
            self._replay_blocks -= sum(num_event_blocks(e) for e in dropped.events)
        return batch

    @property
    def oldest_replayable(self) -> int:
        """Sequence of the oldest batch still in the buffer (last + 1 when empty)."""
        return self._replay[0].sequence if self._replay else self.last_sequence + 1

    def replay_from(self, from_sequence: int) -> list[KVEventBatch] | None:
        """The sealed batches from ``from_sequence`` on, or None if some are gone."""
        if not self.oldest_replayable <= from_sequence <= self.last_sequence + 1:
            return None
        return list(itertools.islice(self._replay, from_sequence - self.oldest_replayable, None))

    def catch_up(
        self,
        from_sequence: int,
        instance_id: int,
        cached_block_hashes: Callable[[], Collection[BlockHash]],
    ) -> list[KVEventBatch]:
        """What a subscriber that applied everything before ``from_sequence`` of
        ``instance_id`` must apply next: the missed batches, or a resync.

        Seal first (or have no pending events) so the snapshot and
        ``last_sequence`` describe the same moment.
        """
        if self._pending:
            raise RuntimeError("seal the current batch before a subscriber catches up")
        if instance_id == self.instance_id:
            missed = self.replay_from(from_sequence)
            if missed is not None:
                return missed
        return make_resync_batches(self.last_sequence, cached_block_hashes(), self.clock())


def chain_runs(block_hashes: Sequence[BlockHash], indices: Sequence[int]) -> list[BlockStored]:
    """``BlockStored`` events for blocks ``indices`` (increasing) of one sequence:
    one per run of consecutive indices, each with its parent's hash."""
    events: list[BlockStored] = []
    start = 0
    for position in range(1, len(indices) + 1):
        if position == len(indices) or indices[position] != indices[position - 1] + 1:
            first = indices[start]
            parent = block_hashes[first - 1] if first > 0 else None
            run = tuple(block_hashes[i] for i in indices[start:position])
            events.append(BlockStored(run, parent))
            start = position
    return events
