"""The load runner: request counts, the concurrency cap, Poisson arrival schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.services.cli.bench.client import ClientConfig, CompletionsClient, RequestOutput
from kvmesh.services.cli.bench.dataset import SampleRequest
from kvmesh.services.cli.bench.metrics import compute_metrics, peak_concurrency
from kvmesh.services.cli.bench.runner import LoadConfig, arrival_offsets, run_load, warm_up
from tests.bench.fake_openai_server import MODEL_ID, FakeOpenAIServer


def requests(num: int, output_len: int = 5) -> list[SampleRequest]:
    return [SampleRequest(f"r{i}", [100 + i] * 4, 4, output_len) for i in range(num)]


async def test_concurrency_cap_is_never_exceeded(fake_server: FakeOpenAIServer) -> None:
    fake_server.reset(first_delay_s=0.02, chunk_delay_s=0.005)
    config = LoadConfig(max_concurrency=3, show_progress=False)
    async with CompletionsClient(ClientConfig(base_url=fake_server.base_url, model=MODEL_ID)) as c:
        result = await run_load(c.send, requests(12), config)
    assert len(result.outputs) == 12 and all(output.success for output in result.outputs)
    assert [output.request_id for output in result.outputs] == [f"r{i}" for i in range(12)]
    assert fake_server.observed.num_requests == 12
    # Seen from the server and from the client's own timestamps.
    assert fake_server.observed.max_in_flight == 3
    assert peak_concurrency(result.outputs) <= 3
    # With 12 requests at once and 3 slots, later requests waited for a slot.
    assert max(output.queue_time for output in result.outputs) > 0.02
    metrics = compute_metrics(result.outputs, result.duration_s)
    assert metrics.total_output_tokens == 60
    assert metrics.completed == 12


async def test_unlimited_concurrency_sends_everything_at_once(
    fake_server: FakeOpenAIServer,
) -> None:
    fake_server.reset(first_delay_s=0.3)
    async with CompletionsClient(ClientConfig(base_url=fake_server.base_url, model=MODEL_ID)) as c:
        result = await run_load(c.send, requests(8, output_len=1), LoadConfig(show_progress=False))
    assert fake_server.observed.max_in_flight == 8
    assert result.arrival_offsets_s == [0.0] * 8


async def test_request_rate_spreads_the_run_over_its_schedule(
    fake_server: FakeOpenAIServer,
) -> None:
    config = LoadConfig(request_rate=40.0, seed=7, show_progress=False)
    async with CompletionsClient(ClientConfig(base_url=fake_server.base_url, model=MODEL_ID)) as c:
        result = await run_load(c.send, requests(8, output_len=1), config)
    assert result.arrival_offsets_s == arrival_offsets(8, 40.0, seed=7)
    # The last request is due at 8 / 40 s, so the run cannot be shorter than that.
    assert result.duration_s >= 8 / 40.0
    assert all(output.success for output in result.outputs)


def test_poisson_schedule_has_the_configured_rate_and_exponential_gaps() -> None:
    offsets = arrival_offsets(4000, request_rate=5.0, seed=0)
    gaps = np.diff([0.0, *offsets])
    assert offsets[-1] == pytest.approx(4000 / 5.0)
    assert gaps.mean() == pytest.approx(0.2)
    assert np.all(gaps > 0)
    # Exponential gaps: standard deviation equals the mean (a fixed pacing would give 0).
    assert 0.9 < gaps.std() / gaps.mean() < 1.1
    assert np.median(gaps) == pytest.approx(0.2 * math.log(2), rel=0.1)


def test_poisson_schedule_is_deterministic_under_the_seed() -> None:
    assert arrival_offsets(50, 2.0, seed=1) == arrival_offsets(50, 2.0, seed=1)
    assert arrival_offsets(50, 2.0, seed=1) != arrival_offsets(50, 2.0, seed=2)
    assert arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


async def test_failed_warm_up_stops_the_benchmark() -> None:
    async def failing_send(request: SampleRequest) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_len, error="HTTP 404: no model")

    with pytest.raises(RuntimeError, match="HTTP 404"):
        await warm_up(failing_send, requests(1)[0], num_requests=1)


@pytest.mark.parametrize("kwargs", [{"request_rate": 0.0}, {"max_concurrency": 0}])
def test_invalid_load_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LoadConfig(**kwargs)
