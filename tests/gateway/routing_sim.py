"""Simulated engine replicas for router tests: a real BlockPool and KVEventLog each,
and the stream between the replica and the router as a queue of protos."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvmesh.gateway.routing.prefix_index import block_key
from kvmesh.gateway.routing.replica_feed import KVEventGap
from kvmesh.gateway.routing.router import Router
from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.block_pool import BlockPool
from kvmesh.scheduler.kv_events import KVEventLog
from kvmesh.scheduler.kv_events_service import ReplicaLoad, batch_to_proto, load_report
from kvmesh.services.contracts.block_hash import BlockHash, extend_block_hashes, sha256_block_hash

BLOCK_SIZE = 4


def block_hashes(tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK_SIZE, salt, sha256_block_hash)
    return hashes


class SimReplica:
    """A replica's prefix cache and its event stream, without a scheduler around them."""

    def __init__(self, name: str, num_blocks: int = 8, max_replay_blocks: int = 16) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.max_replay_blocks = max_replay_blocks
        self.restart()

    def restart(self) -> None:
        """A new scheduler process: empty cache, new instance id, the stream gone."""
        self.log = KVEventLog(max_replay_blocks=self.max_replay_blocks)
        self.pool = BlockPool(self.num_blocks, event_sink=self.log.record)
        # Batches on their way to the router, oldest first.
        self.wire: deque[scheduler_pb2.KVEventBatch] = deque()

    def serve(self, tokens: Sequence[int], salt: str | None = None) -> None:
        """Compute a prompt as the scheduler would: hit the cached prefix, compute
        the rest into fresh blocks, register them, finish (blocks stay cached)."""
        hashes = block_hashes(tokens, salt)
        hits = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hits_free = sum(1 for block in hits if block.ref_cnt == 0)
        if len(hashes) - len(hits) + num_hits_free > self.pool.get_num_free_blocks():
            return
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(len(hashes) - len(hits))
        self.pool.cache_full_blocks(blocks, hashes, len(hits), len(hashes))
        self.pool.free_blocks(reversed(blocks))

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(0, 0, 0, self.num_blocks)

    def seal(self) -> None:
        batch = self.log.seal()
        if batch is not None:
            self.wire.append(batch_to_proto(batch, self.log.instance_id, BLOCK_SIZE, self.load()))

    def report_load(self) -> None:
        """An idle stream's heartbeat: the load, with the last sequence."""
        self.wire.append(load_report(self.log, self.load()))

    def reconnect(self, request: scheduler_pb2.StreamKVEventsRequest) -> None:
        """The stream reopens: the publisher seals, then answers the catch-up."""
        self.seal()
        catch_up = self.log.catch_up(
            request.from_sequence,
            request.instance_id,
            lambda: self.pool.cached_block_hash_to_block.keys(),
        )
        self.wire = deque(
            batch_to_proto(b, self.log.instance_id, BLOCK_SIZE, self.load()) for b in catch_up
        )

    def deliver(self, router: Router, max_batches: int | None = None) -> None:
        """The router applies up to ``max_batches`` batches; a gap reopens the stream."""
        delivered = 0
        while self.wire and (max_batches is None or delivered < max_batches):
            try:
                router.apply_kv_events(self.name, self.wire.popleft())
            except KVEventGap:
                self.reconnect(router.resume_request(self.name))
            delivered += 1

    def cached_keys(self) -> set[int]:
        return {block_key(h) for h in self.pool.cached_block_hash_to_block}

    def caught_up(self, router: Router) -> bool:
        """Everything this replica did has reached the router."""
        feed = router.replica(self.name).feed
        return (
            not self.wire
            and not self.log.has_pending
            and feed.instance_id == self.log.instance_id
            and feed.last_sequence == self.log.last_sequence
        )
