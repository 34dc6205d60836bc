"""Speculative decoding's counters reach Prometheus under vLLM's names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.output import SchedulerStats
from kvmesh.scheduler.spec_decode.speculator import SpecDecodingStats


def test_spec_decode_counters_use_vllm_names() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics("m", registry=registry)
    stats = SchedulerStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.1,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        spec_decoding=SpecDecodingStats(3, 9, 5, [3, 2, 0]),
    )
    metrics.record(stats)
    metrics.record(stats)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("vllm:spec_decode_num_drafts_total") == 6
    assert value("vllm:spec_decode_num_draft_tokens_total") == 18
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 10
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 6
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 4
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
