"""scheduler process: attach to the worker, build the KV block pool, run the step loop."""

from __future__ import annotations

import asyncio
import gc
import logging

from protos import scheduler_pb2, scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.metrics import SchedulerMetrics
from scheduler.service import SchedulerEngine, SchedulerServicer
from scheduler.worker_client import WorkerClient
from services.config import SchedulerServiceConfig
from services.grpc_server import GrpcService
from services.metrics import start_metrics_server

logger = logging.getLogger(__name__)

# The worker may take a while to load weights on a cold machine.
WORKER_CONNECT_TIMEOUT_S = 600.0


async def serve(config: SchedulerServiceConfig, stop: asyncio.Event) -> None:
    start_metrics_server(config.bind_host, config.scheduler_metrics_port)
    worker = WorkerClient(config.worker_addr)
    logger.info("waiting for the worker at %s", config.worker_addr)
    info = await worker.connect(timeout=WORKER_CONNECT_TIMEOUT_S)
    max_model_len = min(info.max_model_len, info.num_kv_blocks * info.block_size)
    if max_model_len < info.max_model_len:
        # A sequence longer than the whole pool could never run, not even alone.
        logger.warning(
            "max_model_len lowered from %d to %d: the KV pool holds only %d tokens",
            info.max_model_len,
            max_model_len,
            max_model_len,
        )
    core_config = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.scheduling_policy,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        enable_prefix_caching=config.prefix_caching,
        async_scheduling=config.async_scheduling,
    )
    logger.info("scheduler config: %s", core_config)
    engine = SchedulerEngine(
        core_config,
        worker,
        list(info.eos_token_ids),
        SchedulerMetrics(info.model_name),
        max_waiting_requests=config.max_waiting_requests,
    )
    scheduler_info = scheduler_pb2.SchedulerInfo(
        model_name=info.model_name,
        max_model_len=max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    service = GrpcService(
        "scheduler", [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]
    )
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(
        SchedulerServicer(engine, scheduler_info), service.server
    )
    await service.start(config.bind_host, config.scheduler_port)
    # Start-up objects live as long as the process: keep the collector off them,
    # so that collections in the step loop only walk per-step garbage.
    gc.collect()
    gc.freeze()
    await service.set_serving(True)
    loop_task = asyncio.create_task(engine.run(stop), name="engine-loop")
    await stop.wait()
    await service.stop(grace=2.0)
    await loop_task
    await worker.close()
