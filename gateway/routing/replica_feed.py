"""One replica's KVEvents stream, applied in order to the prefix index.

The feed remembers where the replica's stream stands (its instance and the
last batch applied), checks that each batch follows the last, and keeps the
replica's latest load. A batch that does not follow (the stream lost
batches, or the scheduler restarted) raises ``KVEventGap`` without touching
the index: the subscriber reconnects with ``resume_request()`` and the
scheduler replays what was missed, or resyncs. Until then the index is only
stale, which costs a worse routing choice, never a wrong answer.
"""

from __future__ import annotations

from kvmesh.gateway.routing.prefix_index import PrefixIndex, block_key
from kvmesh.protos import scheduler_pb2


class KVEventGap(Exception):
    """Batches are missing between the last one applied and this one: reconnect."""


class ReplicaEventFeed:
    """Applies one replica's KV event batches to its slot of the index."""

    def __init__(self, index: PrefixIndex, slot: int) -> None:
        self.index = index
        self.slot = slot
        # The scheduler instance whose batches were applied (0: none yet).
        self.instance_id = 0
        self.last_sequence = 0
        # Latest load reported; None until the first batch.
        self.load: scheduler_pb2.ReplicaLoad | None = None

    def resume_request(self, subscriber: str = "") -> scheduler_pb2.StreamKVEventsRequest:
        """What to (re)open the stream with: everything after the last batch applied."""
        return scheduler_pb2.StreamKVEventsRequest(
            from_sequence=self.last_sequence + 1,
            instance_id=self.instance_id,
            subscriber=subscriber,
        )

    def apply(self, batch: scheduler_pb2.KVEventBatch) -> None:
        """Apply one batch in stream order; KVEventGap if it does not follow the last."""
        if not batch.resync:
            if batch.instance_id != self.instance_id:
                raise KVEventGap(
                    f"batch of scheduler instance {batch.instance_id:x}, "
                    f"expected {self.instance_id:x}"
                )
            expected = self.last_sequence + 1 if batch.events else self.last_sequence
            if batch.sequence != expected:
                raise KVEventGap(f"batch {batch.sequence} after batch {self.last_sequence}")
        index, slot = self.index, self.slot
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                index.store(slot, map(block_key, event.stored.block_hashes))
            elif kind == "removed":
                index.remove(slot, map(block_key, event.removed.block_hashes))
            elif kind == "all_cleared":
                index.clear(slot)
        self.instance_id = batch.instance_id
        self.last_sequence = batch.sequence
        self.load = batch.load
