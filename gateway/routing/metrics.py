"""The router's Prometheus metrics: where requests went and how many replicas could take them.

Plain ``kvmesh_`` names (no colon): dashboards and alerts select them by
these exact names and labels.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
# Exposed as kvmesh_router_replica_waits_total.
REPLICA_WAITS = Counter(
    "kvmesh_router_replica_waits",
    "Requests that found no routable replica and waited for one (a stage restarting) "
    "rather than being refused; those still without one after --migration-timeout-s fail.",
)
REPLICA_WAIT_SECONDS = Histogram(
    "kvmesh_router_replica_wait_seconds",
    "Seconds a request waited for a routable replica (requests that waited only).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
