"""Metrics against hand-computed values on fabricated per-request records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmesh.services.cli.bench.client import RequestOutput
from kvmesh.services.cli.bench.metrics import compute_metrics, peak_concurrency, request_tpot
from kvmesh.services.cli.bench.report import build_result, format_report, write_result


def record(
    start: float,
    ttft: float,
    itl: list[float],
    latency: float,
    output_tokens: int,
    prompt_len: int,
    success: bool = True,
) -> RequestOutput:
    return RequestOutput(
        request_id=f"r{start}",
        prompt_len=prompt_len,
        success=success,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=latency,
        output_tokens=output_tokens,
        error="" if success else "HTTP 500: boom",
    )


# Intervals [0, 0.2), [0.1, 0.5), [0.2, 0.4): at most two overlap at any instant
# (the third starts exactly when the first ends).
RECORDS = [
    record(0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4, 10),
    record(0.1, 0.3, [0.1], 0.4, 2, 20),
    record(0.2, 0.2, [], 0.2, 1, 30),
    record(0.3, 0.0, [], 0.0, 0, 40, success=False),
]
DURATION_S = 2.0
EXACT = dict(rel=1e-9, abs=1e-9)


def test_counts_and_throughputs_use_successful_requests_and_wall_duration() -> None:
    metrics = compute_metrics(RECORDS, DURATION_S)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.total_input_tokens == 60  # the failed request's 40 prompt tokens excluded
    assert metrics.total_output_tokens == 7
    assert metrics.request_throughput == pytest.approx(1.5, **EXACT)
    assert metrics.output_throughput == pytest.approx(3.5, **EXACT)
    assert metrics.total_token_throughput == pytest.approx(33.5, **EXACT)
    assert metrics.output_lens == (4, 2, 1, 0)


def test_ttft_and_e2el_statistics_in_ms() -> None:
    metrics = compute_metrics(RECORDS, DURATION_S, percentiles=(90.0, 99.0))
    ttft = metrics.latencies["ttft"]  # [100, 300, 200] ms
    assert ttft.mean_ms == pytest.approx(200.0, **EXACT)
    assert ttft.median_ms == pytest.approx(200.0, **EXACT)
    assert ttft.std_ms == pytest.approx(math.sqrt(20000 / 3), **EXACT)
    assert dict(ttft.percentiles_ms) == pytest.approx({90.0: 280.0, 99.0: 298.0}, **EXACT)
    e2el = metrics.latencies["e2el"]  # [200, 400, 200] ms
    assert e2el.mean_ms == pytest.approx(800 / 3, **EXACT)
    assert e2el.median_ms == pytest.approx(200.0, **EXACT)
    assert dict(e2el.percentiles_ms) == pytest.approx({90.0: 360.0, 99.0: 396.0}, **EXACT)


def test_tpot_excludes_first_token_and_one_token_answers() -> None:
    metrics = compute_metrics(RECORDS, DURATION_S)
    tpot = metrics.latencies["tpot"]  # (200-100)/3 and (400-300)/1 ms; the 1-token answer skipped
    assert tpot.mean_ms == pytest.approx((100 / 3 + 100) / 2, **EXACT)
    assert tpot.median_ms == pytest.approx((100 / 3 + 100) / 2, **EXACT)
    assert dict(tpot.percentiles_ms)[90.0] == pytest.approx(100 / 3 + 0.9 * (200 / 3), **EXACT)
    assert request_tpot(RECORDS[2]) is None


def test_itl_pools_every_gap_of_every_request() -> None:
    itl = compute_metrics(RECORDS, DURATION_S).latencies["itl"]  # [20, 30, 50, 100] ms
    assert itl.mean_ms == pytest.approx(50.0, **EXACT)
    assert itl.median_ms == pytest.approx(40.0, **EXACT)
    assert dict(itl.percentiles_ms) == pytest.approx({90.0: 85.0, 99.0: 98.5}, **EXACT)


def test_peaks_count_overlap_and_one_second_buckets() -> None:
    assert compute_metrics(RECORDS, DURATION_S).max_concurrent_requests == 2
    assert peak_concurrency(RECORDS[:1] + RECORDS[2:3]) == 1  # back to back, never together
    # Token events at 0.5 | 1.6, 1.7, 1.8 (seconds after the first start): buckets hold 1 and 3.
    spread = [record(0.0, 0.5, [], 0.5, 1, 1), record(1.5, 0.1, [0.1, 0.1], 0.3, 3, 1)]
    assert compute_metrics(spread, DURATION_S).max_output_tokens_per_s == 3.0


def test_all_failed_reports_zeros_instead_of_crashing() -> None:
    metrics = compute_metrics([RECORDS[3]], DURATION_S)
    assert (metrics.completed, metrics.failed, metrics.total_output_tokens) == (0, 1, 0)
    assert metrics.latencies["ttft"].mean_ms == 0.0
    assert metrics.max_concurrent_requests == 0


def test_report_uses_vllm_layout_and_values() -> None:
    metrics = compute_metrics(RECORDS, DURATION_S)
    text = format_report(metrics, request_rate=math.inf, max_concurrency=16)
    lines = text.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert f"{'Successful requests:':<40} {3:<10}" in lines
    assert f"{'Maximum request concurrency:':<40} {16:<10}" in lines
    assert not any(line.startswith("Request rate configured") for line in lines)
    assert f"{'Mean TTFT (ms):':<40} {200.0:<10.2f}" in lines
    assert f"{'P90 ITL (ms):':<40} {85.0:<10.2f}" in lines
    assert f"{'Output token throughput (tok/s):':<40} {3.5:<10.2f}" in lines
    rated = format_report(metrics, request_rate=4.0, max_concurrency=None)
    assert f"{'Request rate configured (RPS):':<40} {4.0:<10.2f}" in rated.splitlines()


def test_result_json_has_config_metrics_and_per_request_arrays(tmp_path: Path) -> None:
    metrics = compute_metrics(RECORDS, DURATION_S)
    config = {"label": "unit", "request_rate": math.inf, "num_prompts": 4}
    result = build_result(config, metrics, RECORDS, [0.0, 0.0, 0.0, 0.0])
    path = tmp_path / "out" / "result.json"
    write_result(path, result)
    loaded = json.loads(path.read_text())
    assert loaded["request_rate"] == "inf"  # JSON has no infinity; vLLM writes the string
    assert loaded["label"] == "unit"
    assert loaded["completed"] == 3
    assert loaded["p99_ttft_ms"] == pytest.approx(298.0, **EXACT)
    assert loaded["median_itl_ms"] == pytest.approx(40.0, **EXACT)
    assert loaded["output_lens"] == [4, 2, 1, 0]
    assert loaded["itls"][0] == [0.02, 0.03, 0.05]
    assert loaded["errors"][3] == "HTTP 500: boom"
    assert len(loaded["ttfts"]) == len(loaded["latencies"]) == len(loaded["start_times"]) == 4
