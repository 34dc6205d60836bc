"""Benchmark metrics, defined exactly as ``vllm bench serve`` defines them.

Over successful requests only:
- throughputs divide by the benchmark's wall duration (first dispatch to last finish);
- TTFT and E2EL: one value per request;
- TPOT per request = (E2EL - TTFT) / (output_tokens - 1), for requests with
  more than one output token (a one-token answer has no time per token);
- ITL: every gap between consecutive token events, pooled over all requests.
Statistics use numpy (``np.percentile`` with linear interpolation, population
``np.std``); an empty series reports 0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.services.cli.bench.client import RequestOutput

DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)
# Series names in vLLM's result keys (mean_ttft_ms, p99_itl_ms, ...) and their report titles.
LATENCY_SERIES: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass(frozen=True)
class LatencyStats:
    """One latency series in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    # (percentile, value in ms), in the order asked for.
    percentiles_ms: tuple[tuple[float, float], ...]

    @classmethod
    def of_seconds(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean_ms=float(np.mean(values)),
            median_ms=float(np.median(values)),
            std_ms=float(np.std(values)),
            percentiles_ms=tuple((p, float(np.percentile(values, p))) for p in percentiles),
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Most output tokens seen in one whole second of the run, and the peak number
    # of requests in flight at any instant (vLLM's "Peak ..." lines).
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latencies: dict[str, LatencyStats] = field(default_factory=dict)
    # Per request, in input order (0 for a failed request).
    output_lens: tuple[int, ...] = ()


def request_tpot(output: RequestOutput) -> float | None:
    """Seconds per output token after the first, or None for a one-token answer."""
    if output.output_tokens <= 1:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [output for output in outputs if output.success]
    total_input = sum(output.prompt_len for output in done)
    total_output = sum(output.output_tokens for output in done)
    series: dict[str, list[float]] = {
        "ttft": [output.ttft for output in done],
        "tpot": [tpot for output in done if (tpot := request_tpot(output)) is not None],
        "itl": [gap for output in done for gap in output.itl],
        "e2el": [output.latency for output in done],
    }
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_output_tokens_per_second(done),
        max_concurrent_requests=peak_concurrency(done),
        latencies={
            name: LatencyStats.of_seconds(values, percentiles) for name, values in series.items()
        },
        output_lens=tuple(output.output_tokens if output.success else 0 for output in outputs),
    )


def peak_output_tokens_per_second(done: Sequence[RequestOutput]) -> float:
    """Token events counted in one-second buckets from the earliest start; the fullest bucket.

    Counts events (as vLLM does), so a chunk that carries several tokens counts once.
    """
    if not done:
        return 0.0
    first_start = min(output.start_time for output in done)
    last_end = max(output.start_time + output.latency for output in done)
    buckets = np.zeros(math.ceil(last_end - first_start) + 1)
    for output in done:
        event_times = (
            output.start_time + output.ttft + np.concatenate([[0.0], np.cumsum(output.itl)])
        )
        indices = (event_times - first_start).astype(np.int64)
        indices = indices[(indices >= 0) & (indices < len(buckets))]
        np.add.at(buckets, indices, 1)
    return float(buckets.max())


def peak_concurrency(done: Sequence[RequestOutput]) -> int:
    """Most requests in flight at one instant, over half-open [start, start + latency)."""
    # A finish sorts before a start at the same instant: the slot was handed over.
    events = sorted(
        [(output.start_time, 1) for output in done]
        + [(output.start_time + output.latency, -1) for output in done]
    )
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return peak
