"""The printed report (``vllm bench serve``'s layout) and the JSON result (its key names)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.services.cli.bench.client import RequestOutput
from kvmesh.services.cli.bench.metrics import LATENCY_SERIES, BenchmarkMetrics

_WIDTH = 50


def percentile_word(percentile: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9' (vLLM's key and label spelling)."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def format_report(
    metrics: BenchmarkMetrics, request_rate: float, max_concurrency: int | None
) -> str:
    def row(label: str, value: float | int) -> str:
        formatted = f"{value:<10}" if isinstance(value, int) else f"{value:<10.2f}"
        return f"{label:<40} {formatted}"

    lines = [
        f"{' Serving Benchmark Result ':=^{_WIDTH}}",
        row("Successful requests:", metrics.completed),
        row("Failed requests:", metrics.failed),
    ]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        row("Benchmark duration (s):", metrics.duration_s),
        row("Total input tokens:", metrics.total_input_tokens),
        row("Total generated tokens:", metrics.total_output_tokens),
        row("Request throughput (req/s):", metrics.request_throughput),
        row("Output token throughput (tok/s):", metrics.output_throughput),
        row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        row("Peak concurrent requests:", float(metrics.max_concurrent_requests)),
        row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for key, name, title in LATENCY_SERIES:
        stats = metrics.latencies[key]
        lines += [
            f"{title:-^{_WIDTH}}",
            row(f"Mean {name} (ms):", stats.mean_ms),
            row(f"Median {name} (ms):", stats.median_ms),
        ]
        lines += [
            row(f"P{percentile_word(p)} {name} (ms):", value) for p, value in stats.percentiles_ms
        ]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def build_result(
    config: dict[str, Any],
    metrics: BenchmarkMetrics,
    outputs: Sequence[RequestOutput],
    arrival_offsets_s: Sequence[float],
) -> dict[str, Any]:
    """Config, metrics and per-request arrays, keyed as vLLM's ``--save-result`` JSON is."""
    result: dict[str, Any] = dict(config)
    result.update(
        duration=metrics.duration_s,
        completed=metrics.completed,
        failed=metrics.failed,
        total_input_tokens=metrics.total_input_tokens,
        total_output_tokens=metrics.total_output_tokens,
        request_throughput=metrics.request_throughput,
        output_throughput=metrics.output_throughput,
        total_token_throughput=metrics.total_token_throughput,
        max_output_tokens_per_s=metrics.max_output_tokens_per_s,
        max_concurrent_requests=metrics.max_concurrent_requests,
    )
    for key, _, _ in LATENCY_SERIES:
        stats = metrics.latencies[key]
        result[f"mean_{key}_ms"] = stats.mean_ms
        result[f"median_{key}_ms"] = stats.median_ms
        result[f"std_{key}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            result[f"p{percentile_word(p)}_{key}_ms"] = value
    result.update(
        input_lens=[output.prompt_len for output in outputs],
        output_lens=list(metrics.output_lens),
        ttfts=[output.ttft for output in outputs],
        itls=[output.itl for output in outputs],
        latencies=[output.latency for output in outputs],
        start_times=[output.start_time for output in outputs],
        queue_times=[output.queue_time for output in outputs],
        arrival_offsets=list(arrival_offsets_s),
        errors=[output.error for output in outputs],
        generated_texts=[output.generated_text for output in outputs],
    )
    return result


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # math.inf (an unlimited request rate) is not JSON; vLLM writes it as the string "inf".
    cleaned = {
        key: ("inf" if isinstance(value, float) and math.isinf(value) else value)
        for key, value in result.items()
    }
    path.write_text(json.dumps(cleaned, indent=2) + "\n")
