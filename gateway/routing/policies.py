"""How a replica is chosen: by prefix overlap weighed against load, by load, or in turn.

Every policy sees only routable replicas (at least one) and picks one of them,
so whatever the index claims, a request lands on a replica that serves: a
stale index costs cache hits, never a failed request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.replica_state import ReplicaState
from kvmesh.services.runtime.config import RoutingPolicyName


class RoutingReason(StrEnum):
    """Why a replica was chosen (a metrics label)."""

    KV_COST = "kv_cost"
    IMBALANCE = "imbalance"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


# The replica chosen, and why.
Choice = tuple[ReplicaState, RoutingReason]


@dataclass(frozen=True)
class PromptOverlap:
    """A prompt as routing sees it: ``num_blocks`` full blocks a cache could
    serve, of which ``overlaps[replica]`` leading ones are cached on that
    replica (absent: none), out of ``num_prompt_blocks`` blocks the prompt
    fills in all. Empty for policies that ignore the cache."""

    num_blocks: int = 0
    overlaps: Mapping[ReplicaState, int] = field(default_factory=dict)
    num_prompt_blocks: int = 0

    def blocks_to_prefill(self, replica: ReplicaState) -> int:
        return self.num_blocks - self.overlaps.get(replica, 0)

    def new_blocks(self, replica: ReplicaState) -> int:
        """Blocks the request would add to ``replica``'s active ones: all its
        blocks but the cached prefix, which running requests (or the cache)
        already hold there."""
        return max(0, self.num_prompt_blocks - self.overlaps.get(replica, 0))


_BY_LOAD = attrgetter("num_requests", "num_active_blocks")
_BY_ACTIVE_BLOCKS = attrgetter("num_active_blocks", "num_requests")
_REQUESTS = attrgetter("num_requests")


def _rotated(candidates: Sequence[ReplicaState], turn: int) -> list[ReplicaState]:
    """``candidates`` starting at ``turn``: ``min`` over it breaks ties in turn."""
    start = turn % len(candidates)
    return [*candidates[start:], *candidates[:start]]


def least_loaded(candidates: Sequence[ReplicaState], turn: int) -> ReplicaState:
    """Fewest requests, then fewest active blocks; ties in turn."""
    return min(_rotated(candidates, turn), key=lambda r: (r.num_requests, r.num_active_blocks))


class RoutingPolicy(ABC):
    # Whether ``choose`` reads prefix overlaps (the router hashes the prompt only then).
    needs_overlaps = False

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, candidates: Sequence[ReplicaState], prompt: PromptOverlap) -> Choice:
        """Pick one of ``candidates`` (non-empty) for ``prompt``."""
        self._turn += 1
        return self._choose(candidates, prompt)

    @abstractmethod
    def _choose(self, candidates: Sequence[ReplicaState], prompt: PromptOverlap) -> Choice: ...


class RoundRobinPolicy(RoutingPolicy):
    def _choose(self, candidates: Sequence[ReplicaState], prompt: PromptOverlap) -> Choice:
        return candidates[self._turn % len(candidates)], RoutingReason.ROUND_ROBIN


class LeastLoadedPolicy(RoutingPolicy):
    def _choose(self, candidates: Sequence[ReplicaState], prompt: PromptOverlap) -> Choice:
        return least_loaded(candidates, self._turn), RoutingReason.LEAST_LOADED


class KVAwarePolicy(RoutingPolicy):
    """NVIDIA Dynamo's cost, SGLang's escape hatch.

    Cost of a replica: ``config.overlap_weight`` x blocks it would have to
    prefill (the prompt's cacheable blocks it does not hold) + the blocks it
    would hold for decoding once the request is in: its active blocks plus the
    request's own new ones. A cached prefix counts once: the requests sharing
    it already hold it, so it is not load the newcomer adds (counting it again
    would push a hot prefix's users off the replica that holds it, each a
    cache miss). The cheapest wins, ties to fewer requests (then to replicas
    holding none of the prompt, in turn, and then to the holder found first).
    But when the loads are imbalanced (the busiest replica has
    more than ``config.balance_abs_threshold`` requests more than the idlest,
    and more than ``balance_rel_threshold`` times as many), the idlest replica
    wins regardless of cache: one hot prefix must not pile every request onto
    one replica.
    """

    needs_overlaps = True

    def is_imbalanced(self, candidates: Sequence[ReplicaState]) -> bool:
        low, high = min(map(_REQUESTS, candidates)), max(map(_REQUESTS, candidates))
        config = self.config
        return (
            high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold
        )

    def _choose(self, candidates: Sequence[ReplicaState], prompt: PromptOverlap) -> Choice:
        if self.is_imbalanced(candidates):
            return least_loaded(candidates, self._turn), RoutingReason.IMBALANCE
        weight = self.config.overlap_weight
        # Replicas that hold none of the prompt differ only by load: the best
        # of them has the fewest active blocks (found at C speed). Only the
        # holders, usually few, are costed one by one.
        best = min(_rotated(candidates, self._turn), key=_BY_ACTIVE_BLOCKS)
        best_cost = (
            weight * prompt.num_blocks + best.num_active_blocks + prompt.num_prompt_blocks,
            best.num_requests,
        )
        for replica, overlap in prompt.overlaps.items():
            cost = (
                weight * (prompt.num_blocks - overlap)
                + replica.num_active_blocks
                + prompt.new_blocks(replica),
                replica.num_requests,
            )
            if cost < best_cost:
                best, best_cost = replica, cost
        return best, RoutingReason.KV_COST


POLICY_CLASSES: dict[RoutingPolicyName, type[RoutingPolicy]] = {
    RoutingPolicyName.KV: KVAwarePolicy,
    RoutingPolicyName.LOAD: LeastLoadedPolicy,
    RoutingPolicyName.ROUND_ROBIN: RoundRobinPolicy,
}


def make_routing_policy(config: RouterConfig) -> RoutingPolicy:
    return POLICY_CLASSES[RoutingPolicyName(config.policy)](config)
