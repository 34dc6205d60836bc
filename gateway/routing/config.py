"""The router's settings: the policy (a gateway flag) and its tuning (defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.runtime.config import ROUTING_POLICIES, RoutingPolicyName, check_choice


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the gateway picks a replica; ``block_size`` must be the schedulers'
    (SchedulerInfo.block_size), or no prompt hash would ever match theirs."""

    block_size: int
    policy: str = RoutingPolicyName.KV
    # Dynamo's kv-overlap-score-weight (--routing-overlap-weight): how many
    # active blocks one block of prefill is worth. Higher favours cache hits
    # (TTFT), lower spreads decode load (ITL).
    overlap_weight: float = 1.0
    # SGLang's balance thresholds: loads count as imbalanced when the busiest
    # replica has more than ``balance_abs_threshold`` requests more than the
    # idlest and more than ``balance_rel_threshold`` times as many.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        check_choice("policy", self.policy, ROUTING_POLICIES)
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("need balance_abs_threshold >= 0 and balance_rel_threshold >= 1")
