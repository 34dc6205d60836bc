"""What the router knows of one replica: its event feed, its load, whether it serves."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.gateway.routing.replica_feed import ReplicaEventFeed
from kvmesh.protos import scheduler_pb2


@dataclass(eq=False)
class ReplicaState:
    """One engine replica as the router sees it.

    The load is the replica's last report plus what the router sent it since:
    requests routed between two reports are in neither, and without them a
    burst would pile onto whichever replica looked idlest. The next report
    replaces the estimate. Plain attributes, not properties: the kv policy
    reads them for every replica on every request.
    """

    name: str
    # Bit position in the prefix index's masks; reused after the replica leaves.
    slot: int
    feed: ReplicaEventFeed
    routable: bool = True
    # Running + waiting requests.
    num_requests: int = 0
    # KV blocks held by requests, and needed by the queued ones.
    num_active_blocks: int = 0
    # Requests routed here over the router's life (for logs and metrics).
    num_routed: int = 0

    def report_load(self, load: scheduler_pb2.ReplicaLoad) -> None:
        self.num_requests = load.num_running + load.num_waiting
        self.num_active_blocks = load.num_active_blocks + load.num_waiting_blocks

    def count_routed(self, num_new_blocks: int) -> None:
        """Until the next report: one more request, holding ``num_new_blocks`` more."""
        self.num_requests += 1
        self.num_active_blocks += num_new_blocks
        self.num_routed += 1
