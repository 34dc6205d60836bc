"""What the router knows of one replica: its event feed, its load, whether it serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.replica_feed import ReplicaEventFeed
from protos import scheduler_pb2


@dataclass(eq=False)
class ReplicaState:
    """One engine replica as the router sees it.

    The load is the replica's last report plus what the router sent it since
    (``pending_*``): requests routed between two reports are not in either
    yet, and without them a burst would pile onto whichever replica looked
    idlest. The next report supersedes the estimate.
    """

    name: str
    # Bit position in the prefix index's masks; reused after the replica leaves.
    slot: int
    feed: ReplicaEventFeed
    routable: bool = True
    reported_requests: int = 0
    reported_active_blocks: int = 0
    pending_requests: int = 0
    pending_blocks: int = 0
    # Requests routed here over the replica's life (for logs and metrics).
    num_routed: int = field(default=0)

    @property
    def num_requests(self) -> int:
        """Running + waiting requests, as reported, plus those routed since."""
        return self.reported_requests + self.pending_requests

    @property
    def num_active_blocks(self) -> int:
        """KV blocks held by requests, as reported, plus the prompts routed since."""
        return self.reported_active_blocks + self.pending_blocks

    def report_load(self, load: scheduler_pb2.ReplicaLoad) -> None:
        self.reported_requests = load.num_running + load.num_waiting
        self.reported_active_blocks = load.num_active_blocks
        self.pending_requests = self.pending_blocks = 0

    def count_routed(self, num_prompt_blocks: int) -> None:
        self.pending_requests += 1
        self.pending_blocks += num_prompt_blocks
        self.num_routed += 1
