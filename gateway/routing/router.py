"""The router: engine replicas, what each has cached and how busy it is, and the pick.

Feeding: for each replica, open its scheduler's ``KVEvents.StreamKVEvents``
with ``resume_request(name)`` and hand every batch to
``apply_kv_events(name, batch)``; on ``KVEventGap`` (or a broken stream)
reopen with a fresh ``resume_request`` (``kv_event_subscriber`` does this).
Picking: ``pick(prompt_token_ids, cache_salt)`` names the replica to send the
request to. Membership: ``add_replica`` / ``remove_replica`` as replicas come
and go, ``set_routable`` as their readiness flips.

Pure and single-threaded: call it from the gateway's event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.policies import PromptOverlap, RoutingReason, make_routing_policy
from kvmesh.gateway.routing.prefix_index import PrefixIndex, block_key
from kvmesh.gateway.routing.replica_feed import ReplicaEventFeed
from kvmesh.gateway.routing.replica_state import ReplicaState
from kvmesh.protos import scheduler_pb2
from kvmesh.services.contracts.block_hash import BlockHash, extend_block_hashes, sha256_block_hash
from kvmesh.services.contracts.errors import UnavailableError
from kvmesh.services.contracts.math_utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingDecision:
    """Where a request goes, and what the router expected to find there."""

    replica: str
    reason: RoutingReason
    # Full prompt blocks a prefix cache could serve (all but the last token's).
    num_cacheable_blocks: int
    # Of those, leading blocks the chosen replica holds, per the index. Both 0
    # when the policy ignores the cache.
    num_overlap_blocks: int


class Router:
    """Replicas by name, the prefix index of their caches, and the policy."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_routing_policy(config)
        self.index = PrefixIndex()
        self._replicas: dict[str, ReplicaState] = {}
        self._free_slots: list[int] = []
        self._by_slot: dict[int, ReplicaState] = {}
        # Routable replicas in slot order, and their slots as a bitmask.
        self._candidates: list[ReplicaState] = []
        self._candidate_mask = 0

    # ---- membership ---------------------------------------------------------

    def add_replica(self, name: str) -> None:
        """A replica that serves: routable at once, its cache unknown until its events come."""
        if name in self._replicas:
            raise ValueError(f"replica {name!r} is already known")
        # Lowest free slot first keeps the index's bitmasks short.
        self._free_slots.sort(reverse=True)
        slot = self._free_slots.pop() if self._free_slots else len(self._replicas)
        replica = ReplicaState(name, slot, ReplicaEventFeed(self.index, slot))
        self._replicas[name] = self._by_slot[slot] = replica
        self._refresh_candidates()
        logger.info("replica %s joined the routing set (slot %d)", name, slot)

    def remove_replica(self, name: str) -> None:
        """Forget a replica and everything it had cached (O(its blocks))."""
        replica = self._replicas.pop(name)
        del self._by_slot[replica.slot]
        self.index.clear(replica.slot)
        self._free_slots.append(replica.slot)
        self._refresh_candidates()
        logger.info("replica %s left the routing set", name)

    def set_routable(self, name: str, routable: bool) -> None:
        """Take a replica out of the picks (not ready) or back in; its index stays."""
        replica = self._replicas[name]
        if replica.routable != routable:
            replica.routable = routable
            self._refresh_candidates()
            logger.info("replica %s %s", name, "routable again" if routable else "not routable")

    @property
    def num_routable(self) -> int:
        """Replicas a request may be sent to now."""
        return len(self._candidates)

    def has_replica(self, name: str) -> bool:
        return name in self._replicas

    def replica(self, name: str) -> ReplicaState:
        return self._replicas[name]

    def _refresh_candidates(self) -> None:
        routable = [r for r in self._replicas.values() if r.routable]
        self._candidates = sorted(routable, key=lambda r: r.slot)
        self._candidate_mask = sum(1 << r.slot for r in routable)

    # ---- KV events ------------------------------------------------------------

    def resume_request(
        self, name: str, subscriber: str = "gateway"
    ) -> scheduler_pb2.StreamKVEventsRequest:
        return self._replicas[name].feed.resume_request(subscriber)

    def forget_cache(self, name: str) -> None:
        """Drop what ``name``'s events said (its index slot, its stream position, its
        load): the gateway stopped following them, and a later stream starts afresh
        with a resync."""
        replica = self._replicas[name]
        self.index.clear(replica.slot)
        replica.feed = ReplicaEventFeed(self.index, replica.slot)
        replica.num_requests = replica.num_active_blocks = 0

    def apply_kv_events(self, name: str, batch: scheduler_pb2.KVEventBatch) -> None:
        """Apply the next batch of ``name``'s stream; KVEventGap: reopen it."""
        replica = self._replicas[name]
        replica.feed.apply(batch)
        if batch.HasField("load"):
            replica.report_load(batch.load)

    # ---- picking --------------------------------------------------------------

    def prompt_block_hashes(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The scheduler's hashes of the prompt's blocks that a cache could serve:
        full blocks, and not the one holding the last token (its logits must be
        computed, so the scheduler never takes it from the cache)."""
        block_size = self.config.block_size
        cacheable = (len(prompt_token_ids) - 1) // block_size * block_size
        hashes: list[BlockHash] = []
        extend_block_hashes(
            hashes, prompt_token_ids[:cacheable], block_size, cache_salt, sha256_block_hash
        )
        return hashes

    def prompt_keys(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[int]:
        """The index keys of ``prompt_block_hashes`` (the hashing half of ``pick``)."""
        return [block_key(h) for h in self.prompt_block_hashes(prompt_token_ids, cache_salt)]

    def pick(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> RoutingDecision:
        """Choose a routable replica for a prompt; UnavailableError if none serves."""
        keys = self.prompt_keys(prompt_token_ids, cache_salt) if self.policy.needs_overlaps else []
        return self.pick_by_keys(keys, len(prompt_token_ids))

    def pick_by_keys(self, keys: Sequence[int], num_prompt_tokens: int) -> RoutingDecision:
        """``pick`` for a prompt already hashed into ``keys`` (the deciding half)."""
        candidates = self._candidates
        if not candidates:
            raise UnavailableError("no engine replica is ready")
        num_prompt_blocks = cdiv(num_prompt_tokens, self.config.block_size)
        prompt = PromptOverlap(num_prompt_blocks=num_prompt_blocks)
        if self.policy.needs_overlaps:
            by_slot = self._by_slot
            overlaps = self.index.overlaps(keys, self._candidate_mask)
            prompt = PromptOverlap(
                len(keys), {by_slot[s]: n for s, n in overlaps.items()}, num_prompt_blocks
            )
        replica, reason = self.policy.choose(candidates, prompt)
        replica.count_routed(prompt.new_blocks(replica))
        return RoutingDecision(
            replica=replica.name,
            reason=reason,
            num_cacheable_blocks=prompt.num_blocks,
            num_overlap_blocks=prompt.num_blocks - prompt.blocks_to_prefill(replica),
        )
