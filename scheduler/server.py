"""scheduler process: attach to the worker, build the KV block pool, run the step loop."""

from __future__ import annotations

import asyncio
import gc
import logging

from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from kvmesh.scheduler.config import SchedulerConfig, step_token_budget
from kvmesh.scheduler.kv_events_service import KVEventsServicer, attach_publisher
from kvmesh.scheduler.kv_leases import StoreLeases
from kvmesh.scheduler.kv_lookup import StorePrefixLookup
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.request_tracing import SchedulerRequestTraces
from kvmesh.scheduler.service import SchedulerEngine, SchedulerServicer
from kvmesh.scheduler.worker_client import WorkerClient
from kvmesh.services.contracts.block_hash import get_block_hasher
from kvmesh.services.contracts.kv_cache_groups import longest_fitting_len, windows_from_wire
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.step_deadline import StepDeadline, StepDeadlinePolicy
from kvmesh.services.runtime.config import SchedulerServiceConfig
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import GrpcService
from kvmesh.services.runtime.metrics import start_metrics_server
from kvmesh.services.runtime.tracing import start_tracing

logger = logging.getLogger(__name__)

# The worker may take a while to load weights on a cold machine.
WORKER_CONNECT_TIMEOUT_S = 600.0
# The calls that carry one request, each a span of its trace; the streams
# carry many requests and pass each one's context in its messages.
TRACED_METHODS = ("AddRequest", "Prefill")


async def serve(config: SchedulerServiceConfig, stop: asyncio.Event) -> None:
    start_metrics_server(config, config.scheduler_metrics_port)
    tracing = start_tracing("scheduler", config.otlp_traces_endpoint)
    security = InternalSecurity.from_config(config)
    worker = WorkerClient(config.worker_addr, security)
    logger.info("waiting for the worker at %s", config.worker_addr)
    info = await worker.connect(timeout=WORKER_CONNECT_TIMEOUT_S)
    pooling = info.runner == "pooling"
    # The model's KV-cache groups by window (0 on the wire: full attention).
    kv_cache_windows = windows_from_wire(info.kv_cache_group_windows)
    token_budget = step_token_budget(config.max_num_batched_tokens, info.step_token_budget)
    max_model_len = (
        info.max_model_len
        if pooling
        else longest_fitting_len(
            kv_cache_windows,
            info.max_model_len,
            info.num_kv_blocks,
            info.block_size,
            token_budget,
        )
    )
    if max_model_len < info.max_model_len:
        # A sequence longer than the whole pool could never run, not even alone.
        logger.warning(
            "max_model_len lowered from %d to %d: the KV pool holds only %d tokens",
            info.max_model_len,
            max_model_len,
            max_model_len,
        )
    speculative = config.speculative
    async_scheduling = config.async_scheduling and speculative is None
    if speculative is not None and config.async_scheduling:
        logger.info(
            "speculative decoding on: async scheduling turned off (drafts need the "
            "latest tokens at schedule time)"
        )
    # Pipeline overlap: one micro-batch per stage in flight (needs async scheduling).
    num_micro_batches = (
        info.pipeline_parallel_size if info.pipeline_overlap and async_scheduling else 1
    )
    if config.max_num_batched_tokens == 0:
        logger.info(
            "step token budget %d: what the worker (%s, %s) runs best at",
            token_budget,
            info.device,
            info.dtype,
        )
    num_kv_blocks = info.num_kv_blocks
    if pooling:
        # An encoder's input runs whole in one step: longer than the step
        # budget, it could never run, so the budget bounds its length too.
        # Pooling requests take no KV blocks; the pool exists, empty, only
        # because the core's config asks for one that holds max_model_len.
        max_model_len = min(max_model_len, token_budget)
        num_kv_blocks = cdiv(max_model_len, info.block_size)
        logger.info("pooling runner: whole inputs of up to %d tokens, no KV blocks", max_model_len)
    core_config = SchedulerConfig(
        max_num_batched_tokens=token_budget,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.scheduling_policy,
        block_size=info.block_size,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=config.prefix_caching and not pooling,
        async_scheduling=async_scheduling,
        num_micro_batches=max(1, num_micro_batches),
        enable_kv_connector=config.kv_offload,
        speculative=speculative,
        max_loras=info.max_loras,
        pooling=pooling,
        kv_cache_windows=kv_cache_windows,
    )
    logger.info("scheduler config: %s", core_config)
    kvstore = KVStoreClient(config.kvstore_addr, security=security) if config.kv_offload else None
    kv_lookup = _store_lookup(kvstore, info, core_config) if kvstore is not None else None
    kv_leases = (
        StoreLeases(kv_lookup.store, kv_lookup.layouts, config.kv_transfer_lease_ttl_s)
        if kv_lookup is not None
        else None
    )
    engine = SchedulerEngine(
        core_config,
        worker,
        list(info.eos_token_ids),
        SchedulerMetrics(info.model_name),
        max_waiting_requests=config.max_waiting_requests,
        kv_lookup=kv_lookup,
        step_deadline=StepDeadline(StepDeadlinePolicy.from_options(config)),
        kv_leases=kv_leases,
        traces=SchedulerRequestTraces(tracing) if tracing is not None else None,
        max_migrations=config.max_migrations,
        subscriber_grace_s=config.migration_timeout_s,
    )
    scheduler_info = scheduler_pb2.SchedulerInfo(
        model_name=info.model_name,
        max_model_len=max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=token_budget,
        max_waiting_requests=config.max_waiting_requests,
        dtype=info.dtype,
        dtype_reason=info.dtype_reason,
        quantization=info.quantization,
        runner=info.runner or "generate",
        pooling_tasks=info.pooling_tasks,
        embedding_dim=info.embedding_dim,
        matryoshka_dimensions=info.matryoshka_dimensions,
        labels=info.labels,
        weight_bytes=info.weight_bytes,
        batch_invariant=info.batch_invariant,
    )
    services = scheduler_pb2.DESCRIPTOR.services_by_name
    service = GrpcService(
        "scheduler",
        [services["Scheduler"].full_name, services["KVEvents"].full_name],
        access=security,
        interceptors=[tracing.server_interceptor(TRACED_METHODS)] if tracing is not None else (),
    )
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(
        SchedulerServicer(engine, scheduler_info), service.server
    )
    scheduler_pb2_grpc.add_KVEventsServicer_to_server(
        KVEventsServicer(attach_publisher(engine.core)), service.server
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
    if kv_leases is not None:
        await kv_leases.drain()
    if kvstore is not None:
        await kvstore.close()
    if tracing is not None:
        tracing.shutdown()


def _store_lookup(
    client: KVStoreClient, info: worker_pb2.WorkerInfo, core_config: SchedulerConfig
) -> StorePrefixLookup:
    """Lookups under the worker's KV layout, hashed as the scheduler hashes blocks."""
    if not info.HasField("kv_layout"):
        raise RuntimeError("--kv-offload: the worker runs without it (start both with the flag)")
    layout = KVLayout.from_proto(info.kv_layout)
    logger.info("KV offload on: kvstore at %s, layout %s", client.address, layout)
    return StorePrefixLookup(
        client, [layout], core_config.block_size, get_block_hasher(core_config.prefix_hash)
    )
