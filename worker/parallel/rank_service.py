"""The process of a worker rank other than the driver: join, load a shard, follow.

It serves no gRPC: the scheduler only talks to the driver, and the launcher
watches this process by its life alone. A replica lives and dies as one: a
rank whose collective fails (a peer died, or hung past ``dist_timeout_s``)
exits at once with ``FATAL_EXIT_CODE``, and the launcher restarts every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from kvmesh.services.runtime.config import WorkerConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.driver import follow_driver
from kvmesh.worker.parallel.layout import RankLayout

logger = logging.getLogger(__name__)

# Exit status of a rank that left its replica out of step (distinct from a crash
# at start-up, for the logs; the launcher restarts the replica either way).
FATAL_EXIT_CODE = 3


def rank_device(device: str, rank: int) -> torch.device:
    """Each rank of a CUDA replica on its own GPU (NCCL refuses two ranks on one);
    on CPU every rank shares the host's cores."""
    if device.startswith("cuda") and ":" not in device:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


def connect_ranks(config: WorkerConfig, layout: RankLayout) -> Collectives:
    """Join the replica's process groups (blocks until every rank has joined)."""
    device = rank_device(config.device, layout.rank)
    return Collectives(layout, config.dist_init_addr, config.dist_timeout_s, device)


async def serve_rank(
    config: WorkerConfig,
    layout: RankLayout,
    stop: asyncio.Event,
    build_runner: Callable[[WorkerConfig, Collectives], tuple[ModelRunner, Any]],
    connect_kv_offload: Callable[[WorkerConfig, ModelRunner, Any], Awaitable[tuple[Any, Any]]],
) -> None:
    """Run the rank until the driver says stop or this process is asked to.

    ``build_runner`` and ``connect_kv_offload`` are the driver's own (worker/server.py):
    with ``--kv-offload`` this rank saves and loads its shard of each block too.
    """
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()

    def life() -> None:
        try:
            collectives = connect_ranks(config, layout)
            runner, info = build_runner(config, collectives)
            if config.kv_offload:  # the store client lives on the event loop
                connecting = connect_kv_offload(config, runner, info)
                asyncio.run_coroutine_threadsafe(connecting, loop).result()
            logger.info("rank %d ready: layers %s", layout.rank, runner.plan.layers)
            follow_driver(runner, collectives)
            collectives.close()
        except Exception:
            logger.exception("rank %d lost its replica; exiting", layout.rank)
            os._exit(FATAL_EXIT_CODE)
        loop.call_soon_threadsafe(finished.set)

    # A daemon thread: a stop request must not wait for a collective in progress.
    threading.Thread(target=life, name="model-step", daemon=True).start()
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(finished.wait())]
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
