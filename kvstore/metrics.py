"""Prometheus metrics of the kvstore.

Occupancy and the store's own counters (hits, misses, evictions, corrupt
blocks, failed puts, leases) are exported from a ``StoreStats`` snapshot that
the event loop refreshes (``StoreCollector.update``); the scrape runs on
prometheus_client's HTTP thread and must never touch the live store. Byte
counts and latencies are observed by the servicer as they happen.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.kvstore.tiered import StoreStats

BYTES_IN = Counter("kvmesh:kvstore_bytes_in", "block bytes received by PutBlocks")
BYTES_OUT = Counter("kvmesh:kvstore_bytes_out", "block bytes sent by GetBlocks")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
PUT_SECONDS = Histogram(
    "kvmesh:kvstore_put_seconds", "PutBlocks stream duration", buckets=_LATENCY_BUCKETS
)
GET_SECONDS = Histogram(
    "kvmesh:kvstore_get_seconds",
    "GetBlocks duration, lookup to last chunk sent",
    buckets=_LATENCY_BUCKETS,
)

# (metric, type, TierSnapshot field, help): one series per tier.
_PER_TIER = (
    ("kvmesh:kvstore_blocks", GaugeMetricFamily, "num_blocks", "blocks held"),
    ("kvmesh:kvstore_bytes_used", GaugeMetricFamily, "bytes_used", "bytes held"),
    ("kvmesh:kvstore_capacity_bytes", GaugeMetricFamily, "capacity_bytes", "capacity (0: none)"),
    ("kvmesh:kvstore_hits", CounterMetricFamily, "hits", "requested blocks served"),
    ("kvmesh:kvstore_evictions", CounterMetricFamily, "evictions", "blocks dropped for room"),
)


class StoreCollector(Collector):
    """Exports the latest StoreStats snapshot."""

    def __init__(self, snapshot: StoreStats) -> None:
        self._snapshot = snapshot

    def update(self, snapshot: StoreStats) -> None:
        self._snapshot = snapshot  # one reference swap: the scrape thread sees old or new

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot
        for name, family_type, attr, doc in _PER_TIER:
            family = family_type(name, doc, labels=["tier"])
            for tier in s.tiers:
                family.add_metric([tier.tier], getattr(tier, attr))
            yield family
        corrupt = CounterMetricFamily(
            "kvmesh:kvstore_corrupt_blocks",
            "blocks rejected for a size or CRC-32 mismatch (put: at commit), never served",
            labels=["source"],
        )
        corrupt.add_metric(["put"], s.failed_puts.get("corrupt", 0))
        for tier in s.tiers[1:]:
            corrupt.add_metric([tier.tier], tier.corrupt_blocks)
        yield corrupt
        failed = CounterMetricFamily(
            "kvmesh:kvstore_failed_puts", "blocks whose put stored nothing", labels=["reason"]
        )
        for reason in ("no_room", "corrupt", "aborted"):
            failed.add_metric([reason], s.failed_puts.get(reason, 0))
        yield failed
        yield CounterMetricFamily(
            "kvmesh:kvstore_misses", "requested blocks found in no tier", value=s.misses
        )
        yield GaugeMetricFamily("kvmesh:kvstore_leases", "live leases", value=s.num_leases)
        yield GaugeMetricFamily(
            "kvmesh:kvstore_inflight_puts", "puts begun, not yet ended", value=s.inflight_puts
        )
