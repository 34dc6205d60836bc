"""The router's Prometheus metrics: where requests went and how many replicas could take them.

Plain ``kvmesh_`` names (no colon): dashboards and alerts select them by
these exact names and labels.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

# Exposed as kvmesh_router_decisions_total.
ROUTER_DECISIONS = Counter(
    "kvmesh_router_decisions",
    "Requests routed, by replica chosen, routing policy and reason (kv_cost, imbalance, "
    "least_loaded, round_robin).",
    ["replica", "policy", "reason"],
)
ROUTABLE_REPLICAS = Gauge(
    "kvmesh_router_routable_replicas", "Engine replicas that are ready and take requests now."
)
