"""Drive a fixed set of requests at a request rate, under a concurrency cap, and time the run.

As in ``vllm bench serve``: arrivals follow a precomputed schedule (Poisson
by default, everything at once for an infinite rate); a request that arrives
while ``max_concurrency`` requests are in flight waits for a slot, and that
wait is its queue time, not part of its latency; the benchmark's duration runs
from the first dispatch until the last request finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from kvmesh.services.cli.bench.client import RequestOutput
from kvmesh.services.cli.bench.dataset import SampleRequest

logger = logging.getLogger(__name__)

SendFn = Callable[[SampleRequest], Awaitable[RequestOutput]]


@dataclass(frozen=True)
class LoadConfig:
    # Requests per second; math.inf sends every request at once.
    request_rate: float = math.inf
    # Most requests in flight at once; None leaves it to the request rate.
    max_concurrency: int | None = None
    seed: int = 0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class LoadResult:
    outputs: list[RequestOutput]
    duration_s: float
    # When each request was due, in seconds after the run started.
    arrival_offsets_s: list[float]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Cumulative send times of a Poisson process at ``request_rate`` (all zero for inf).

    Like vLLM, the exponential gaps are rescaled so the last request is due at
    exactly ``num_requests / request_rate``: a raw sum drifts a few percent from
    the target with the seed, and so would the measured throughput.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(scale=1.0 / request_rate, size=num_requests))
    offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def warm_up(send: SendFn, request: SampleRequest, num_requests: int) -> None:
    """Send ``num_requests`` untimed requests one after another; raise if any fails."""
    for _ in range(num_requests):
        output = await send(request)
        if not output.success:
            raise RuntimeError(f"warm-up request failed: {output.error}")


async def run_load(
    send: SendFn, requests: Sequence[SampleRequest], config: LoadConfig
) -> LoadResult:
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(config.max_concurrency)
        if config.max_concurrency is not None
        else contextlib.nullcontext()
    )
    progress = tqdm(total=len(requests), disable=not config.show_progress, unit="req")

    async def send_when_free(request: SampleRequest) -> RequestOutput:
        arrived = time.perf_counter()
        async with slots:
            output = await send(request)
        output.queue_time = output.start_time - arrived
        progress.update(1)
        return output

    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestOutput]] = []
    for request, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_when_free(request)))
    try:
        outputs = await asyncio.gather(*tasks)
    finally:
        progress.close()
    duration = time.perf_counter() - start
    num_failed = sum(not output.success for output in outputs)
    logger.info("ran %s requests in %.2fs (%s failed)", len(outputs), duration, num_failed)
    return LoadResult(outputs=list(outputs), duration_s=duration, arrival_offsets_s=offsets)
