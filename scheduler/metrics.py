"""The scheduler's Prometheus metrics, with vLLM's names and model_name label."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.scheduler.output import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class SchedulerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=registry)

        self.num_running = gauge("vllm:num_requests_running", "requests in the running batch")
        self.num_waiting = gauge("vllm:num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "fraction of KV blocks in use (0..1)")
        self.preemptions = counter("vllm:num_preemptions", "preemptions by recompute")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "tokens queried")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "tokens found in the prefix cache")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "arrival to first scheduled")
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "first scheduled to first token"
        )
        self.decode_time = histogram("vllm:request_decode_time_seconds", "first token to finished")
        self.migrations = Counter(
            "kvmesh:request_migrations",
            "live requests resumed after a stage was lost (stage=worker: requeued with their "
            "tokens for a restarted worker; stage=detokenizer: outputs republished to a "
            "restarted detokenizer)",
            [*labels, "stage"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "kvmesh:scheduler_step_seconds",
            "wall time of one engine step as seen by the scheduler (schedule+execute+update)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        # KV connector: vLLM's names for what the external cache was asked and
        # supplied (in tokens), kvmesh's for the rest.
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "tokens looked up in the kvstore at admission"
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "tokens loaded from the kvstore instead of computed"
        )
        self.waiting_for_remote_kvs = gauge(
            "kvmesh:num_requests_waiting_for_remote_kvs", "requests whose KV is being loaded"
        )
        self.connector_loads = counter("kvmesh:kv_connector_loads", "loads sent to the worker")
        self.connector_short_loads = counter(
            "kvmesh:kv_connector_short_loads",
            "loads that came back short (missing, corrupt or unreachable blocks: recomputed)",
        )
        self.connector_saves = counter(
            "kvmesh:kv_connector_saved_blocks", "blocks the worker was asked to save"
        )
        self.connector_saves_confirmed = counter(
            "kvmesh:kv_connector_saved_blocks_confirmed", "blocks the store committed"
        )
        self.connector_failed_saves = counter(
            "kvmesh:kv_connector_failed_saves", "blocks the worker could not save"
        )
        self.connector_lookup_failures = counter(
            "kvmesh:kv_connector_lookup_failures",
            "kvstore lookups that failed or timed out (treated as misses)",
        )
        # Speculative decoding, vLLM's names: one draft = one request verifying
        # its draft tokens in one step.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "verifications of draft tokens")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "tokens proposed")
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "draft tokens the model accepted"
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each position of the draft (0-based)",
            ["model_name", "position"],
            registry=registry,
        )
        self.model_name = model_name

    def record(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.preemptions.labels(m).inc(stats.num_preemptions)
        self.prefix_queries.labels(m).inc(stats.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(stats.prefix_cache_hits)
        if stats.kv_connector is not None:
            c = stats.kv_connector
            self.waiting_for_remote_kvs.labels(m).set(stats.num_waiting_for_remote_kvs)
            self.external_hits.labels(m).inc(c.blocks_loaded * c.block_size)
            self.connector_loads.labels(m).inc(c.loads_started)
            self.connector_short_loads.labels(m).inc(c.loads_short)
            self.connector_saves.labels(m).inc(c.blocks_saved_planned)
            self.connector_saves_confirmed.labels(m).inc(c.blocks_saved_confirmed)
            self.connector_failed_saves.labels(m).inc(c.failed_saves)
        if (spec := stats.spec_decoding) is not None:
            self.spec_drafts.labels(m).inc(spec.num_drafts)
            self.spec_draft_tokens.labels(m).inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.labels(m).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                self.spec_accepted_per_pos.labels(m, str(position)).inc(count)
        for finished in stats.finished_requests:
            if finished.queue_time is not None:
                self.queue_time.labels(m).observe(finished.queue_time)
            if finished.prefill_time is not None:
                self.prefill_time.labels(m).observe(finished.prefill_time)
            if finished.decode_time is not None:
                self.decode_time.labels(m).observe(finished.decode_time)
