"""One KV connector answer for a parallel replica: a transfer is done when every rank's is.

Every rank moves its own shard of each block (its KV heads, its stage's
layers) to and from the store under its own layout, on its own schedule: a
load may land on rank 0 a step before rank 1. The scheduler must not count a
block loaded, or saved, until it is on every rank, so each step the ranks
all-gather what finished locally and each keeps the same tally: a load is
finished once every rank reported it, with the fewest blocks any rank loaded
(the rest is recomputed everywhere); a save is settled once every rank settled
it, and saved only if every rank saved its shard.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvmesh.services.contracts.step import KVConnectorOutput, SchedulerOutput
from kvmesh.worker.kv_connector import KVConnectorWorker
from kvmesh.worker.parallel.collectives import Collectives


@dataclass
class TransferTally:
    """What each rank reported so far, for transfers not yet finished everywhere."""

    world_size: int
    loads: dict[str, dict[int, int]] = field(default_factory=dict)  # req -> rank -> blocks
    # hash -> per rank, its outcomes not yet matched (a block saved twice, e.g. by
    # two requests, settles twice: once per outcome every rank reported).
    saves: dict[bytes, list[deque[bool]]] = field(default_factory=dict)

    def forget_loads(self, req_ids: set[str] | list[str]) -> None:
        for req_id in req_ids:
            self.loads.pop(req_id, None)

    def _save_outcomes(self, block_hash: bytes) -> list[deque[bool]]:
        if block_hash not in self.saves:
            self.saves[block_hash] = [deque() for _ in range(self.world_size)]
        return self.saves[block_hash]

    def add(self, per_rank: list[KVConnectorOutput]) -> KVConnectorOutput:
        """Record one step's reports (indexed by rank); return what is now done everywhere."""
        for rank, output in enumerate(per_rank):
            for req_id, num_blocks in output.finished_loads.items():
                self.loads.setdefault(req_id, {})[rank] = num_blocks
            for block_hash in output.saved_block_hashes:
                self._save_outcomes(block_hash)[rank].append(True)
            for block_hash in output.failed_save_hashes:
                self._save_outcomes(block_hash)[rank].append(False)
        done = KVConnectorOutput()
        for req_id in [r for r, ranks in self.loads.items() if len(ranks) == self.world_size]:
            done.finished_loads[req_id] = min(self.loads.pop(req_id).values())
        for block_hash, outcomes in list(self.saves.items()):
            while all(outcomes):
                saved_everywhere = all([rank_outcomes.popleft() for rank_outcomes in outcomes])
                settled = done.saved_block_hashes if saved_everywhere else done.failed_save_hashes
                settled.append(block_hash)
            if not any(outcomes):
                del self.saves[block_hash]
        return done


class ReplicaKVConnector:
    """The runner's connector on a parallel rank: its local connector plus the tally."""

    def __init__(self, local: KVConnectorWorker, collectives: Collectives) -> None:
        self.local = local
        self.collectives = collectives
        self.tally = TransferTally(collectives.layout.world_size)

    @property
    def block_bytes(self) -> int:
        return self.local.block_bytes

    def start_step(self, scheduler_output: SchedulerOutput) -> None:
        # A dropped request's load is cancelled on every rank; a new load of a
        # request starts its count afresh.
        self.tally.forget_loads(scheduler_output.finished_req_ids)
        self.tally.forget_loads([t.req_id for t in scheduler_output.kv_connector_metadata.loads])
        self.local.start_step(scheduler_output)

    def get_finished(self) -> KVConnectorOutput:
        return self.tally.add(self.collectives.all_gather_host(self.local.get_finished()))

    def reset(self) -> None:
        self.local.reset()
        self.tally = TransferTally(self.collectives.layout.world_size)

    async def drain(self) -> None:
        await self.local.drain()
