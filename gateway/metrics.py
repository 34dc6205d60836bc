"""Prometheus metrics of served requests, under vLLM's names so existing dashboards work.

Every metric carries a ``model_name`` label. The gateway observes requests from
the outside (arrival, first delta, each delta, finish), which is what a client
experiences, queueing and network included.
"""

from __future__ import annotations

import time
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from kvmesh.gateway.engine.client import GenerationDelta

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# One set of collectors per registry: registering the same name twice fails,
# and several apps in one process (tests, or a restart of build_app) share the
# global registry.
_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, GatewayMetrics] = (
    weakref.WeakKeyDictionary()
)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", labels, registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive outputs of a request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from arrival to the final output.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt length of finished requests, in tokens.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated length of finished requests, in tokens.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        registry = REGISTRY if registry is None else registry
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = cls(registry)
        return metrics

    def track(self, model_name: str) -> RequestTracker:
        return RequestTracker(self, model_name)


class RequestTracker:
    """Timing and token counts of one engine request, fed with its deltas."""

    def __init__(self, metrics: GatewayMetrics, model_name: str) -> None:
        self._metrics = metrics
        self._model_name = model_name
        self._arrival = time.monotonic()
        self._last_output: float | None = None

    def on_delta(self, delta: GenerationDelta) -> None:
        metrics, model = self._metrics, self._model_name
        now = time.monotonic()
        if delta.token_ids:
            metrics.generation_tokens.labels(model).inc(len(delta.token_ids))
            if self._last_output is None:
                metrics.time_to_first_token.labels(model).observe(now - self._arrival)
            else:
                metrics.inter_token_latency.labels(model).observe(now - self._last_output)
            self._last_output = now
        if delta.finish_reason is not None:
            metrics.prompt_tokens.labels(model).inc(delta.num_prompt_tokens)
            metrics.request_success.labels(model, delta.finish_reason).inc()
            metrics.e2e_request_latency.labels(model).observe(now - self._arrival)
            metrics.request_prompt_tokens.labels(model).observe(delta.num_prompt_tokens)
            metrics.request_generation_tokens.labels(model).observe(delta.num_output_tokens)
