"""worker process: the gRPC Worker service around a ModelRunner.

The scheduler holds one Execute stream open and sends one StepRequest per
engine step. Each step runs on a dedicated thread so that the event loop keeps
answering health checks and GetInfo while a forward pass runs (torch releases
the GIL inside its kernels).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client import Counter, Gauge, Histogram

from kvstore.client import KVStoreClient
from kvstore.layout import KVLayout
from protos import worker_pb2, worker_pb2_grpc
from services.config import WorkerConfig
from services.errors import InvalidRequestError, UnavailableError
from services.grpc_server import GrpcService
from services.metrics import start_metrics_server
from services.model_prep import resolve_model_path
from services.step_codec import (
    model_runner_output_to_proto,
    scheduler_output_from_proto,
    structured_output_from_proto,
)
from services.step_deadline import StepDeadline, StepDeadlinePolicy
from worker.config import CacheConfig, ModelConfig
from worker.kv_connector import KVBlockStore, KVConnectorWorker
from worker.kv_layout import worker_kv_layout
from worker.kvstore_blocks import KVStoreBlocks
from worker.model_runner import ModelRunner
from worker.step_watchdog import StepWatchdog

logger = logging.getLogger(__name__)

_STEP_SECONDS = Histogram(
    "kvmesh:worker_step_seconds",
    "time to execute one engine step (input prep, forward, sampling)",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24),
)
_TOKENS = Counter("kvmesh:worker_tokens_computed_total", "tokens run through the model")
_BATCH = Gauge("kvmesh:worker_batch_size", "requests in the last step")
_KV_BLOCKS = Gauge("kvmesh:worker_num_kv_blocks", "KV cache blocks allocated")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, watchdog: StepWatchdog | None = None) -> None:
        # Set by attach() once the weights are loaded; until then every call
        # answers UNAVAILABLE.
        self.runner: ModelRunner | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        # One thread for every torch call of this process (loading too): steps are
        # strictly ordered, the runner is not reentrant, and OpenMP keeps a team of
        # spinning threads per calling thread, so a second calling thread would
        # double the spinners on 2 cores (measured: batch-16 decode 45 -> 65 ms).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-step")
        # Grammar compiles run beside the steps, never in the step thread.
        self._compile_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._stream_open = False
        # Times steps; liveness fails while one is past its deadline.
        self.watchdog = watchdog

    def attach(self, runner: ModelRunner, info: worker_pb2.WorkerInfo) -> None:
        self.runner, self.info = runner, info

    def _run_step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        start = time.perf_counter()
        scheduler_output = scheduler_output_from_proto(request)
        output = self.runner.execute_model(scheduler_output)
        elapsed = time.perf_counter() - start
        _STEP_SECONDS.observe(elapsed)
        _TOKENS.inc(scheduler_output.total_num_scheduled_tokens)
        _BATCH.set(len(scheduler_output.num_scheduled_tokens))
        return model_runner_output_to_proto(output, execute_seconds=elapsed)

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.StepRequest], context
    ) -> AsyncIterator[worker_pb2.StepResult]:
        if self.runner is None:
            raise UnavailableError("model is still loading")
        if self._stream_open:
            # The persistent batch belongs to one scheduler; a second stream
            # would corrupt it.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a scheduler is attached")
        self._stream_open = True
        logger.info("scheduler attached")
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                timed = (
                    self.watchdog.step(sum(request.num_scheduled_tokens))
                    if self.watchdog is not None
                    else contextlib.nullcontext()
                )
                with timed:
                    result = await loop.run_in_executor(self.executor, self._run_step, request)
                yield result
        finally:
            self._stream_open = False
            # A new scheduler starts from an empty batch.
            await loop.run_in_executor(self.executor, self.runner.reset)
            logger.info("scheduler detached; persistent batch cleared")

    async def PrepareStructuredOutput(
        self, request: worker_pb2.PrepareStructuredOutputRequest, context
    ) -> worker_pb2.PrepareStructuredOutputResponse:
        if self.runner is None:
            raise UnavailableError("model is still loading")
        started = time.perf_counter()
        spec = structured_output_from_proto(request.structured_output)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._compile_executor, self.runner.structured_output.compiler.compile, spec
            )
        except ValueError as exc:
            # The compiler's refusal of a schema, regex or grammar that does not
            # compile: the caller's mistake, unlike any other error in here.
            logger.info("request %s: structured output refused: %s", request.request_id, exc)
            raise InvalidRequestError(str(exc)) from exc
        logger.debug(
            "request %s: %s grammar ready in %.3fs",
            request.request_id,
            spec.kind,
            time.perf_counter() - started,
        )
        return worker_pb2.PrepareStructuredOutputResponse()

    async def GetInfo(self, request, context) -> worker_pb2.WorkerInfo:
        if self.info is None:
            raise UnavailableError("model is still loading")
        return self.info


def build_runner(config: WorkerConfig) -> tuple[ModelRunner, worker_pb2.WorkerInfo]:
    path = resolve_model_path(config.model)
    model_config = ModelConfig.from_pretrained(
        path,
        dtype=config.dtype,
        max_model_len=config.max_model_len or None,
        device=config.device,
    )
    cache_config = CacheConfig(
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or None,
        kv_cache_memory_bytes=None if config.num_kv_blocks else config.kv_cache_memory,
    )
    runner = ModelRunner(
        model_config,
        cache_config,
        device=config.device,
        attention_backend=config.attention_backend or None,
        num_threads=config.num_threads or None,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
    )
    info = worker_pb2.WorkerInfo(
        model_name=config.served_model_name or Path(path).name,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=config.block_size,
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=list(model_config.eos_token_ids),
        attention_backend=runner.attention_backend_name,
        device=config.device,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
    )
    return runner, info


def runner_kv_layout(runner: ModelRunner, info: worker_pb2.WorkerInfo) -> KVLayout:
    """The layout of the runner's KV blocks, named by the served model name."""
    model = runner.model_config
    return worker_kv_layout(
        info.model_name,
        model.dtype,
        info.block_size,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
    )


def attach_kv_connector(
    runner: ModelRunner,
    info: worker_pb2.WorkerInfo,
    store: KVBlockStore,
    layout: KVLayout,
    loop: asyncio.AbstractEventLoop,
) -> KVConnectorWorker:
    """Give the runner a connector to ``store`` and publish its layout in ``info``."""
    connector = KVConnectorWorker(runner.kv_caches, store, loop)
    runner.kv_connector = connector
    info.kv_layout.CopyFrom(layout.to_proto())
    logger.info("KV offload on: %d-byte blocks, layout %s", connector.block_bytes, layout)
    return connector


async def serve(config: WorkerConfig, stop: asyncio.Event) -> None:
    start_metrics_server(config.bind_host, config.worker_metrics_port)
    service = GrpcService("worker", [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name])
    watchdog = StepWatchdog(
        StepDeadline(StepDeadlinePolicy.from_options(config)), service.set_alive_and_ready
    )
    servicer = WorkerServicer(watchdog)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, service.server)
    # Listen (NOT_SERVING) before loading so that health checks answer while
    # the weights load; flip to SERVING once the model is ready.
    await service.start(config.bind_host, config.worker_port)
    loop = asyncio.get_running_loop()
    runner, info = await loop.run_in_executor(servicer.executor, build_runner, config)
    _KV_BLOCKS.set(info.num_kv_blocks)
    logger.info(
        "model %s loaded: %d KV blocks of %d tokens, max_model_len %d, attention %s",
        info.model_name,
        info.num_kv_blocks,
        info.block_size,
        info.max_model_len,
        info.attention_backend,
    )
    store: KVStoreBlocks | None = None
    connector: KVConnectorWorker | None = None
    if config.kv_offload:
        layout = runner_kv_layout(runner, info)
        store = KVStoreBlocks(KVStoreClient(config.kvstore_addr), layout)
        connector = attach_kv_connector(runner, info, store, layout, loop)
    servicer.attach(runner, info)
    # Everything allocated so far (modules, weights' Python wrappers, protobuf
    # descriptors) lives for the whole process: move it out of the collector's
    # generations, so that a collection during a step scans only per-step garbage.
    gc.collect()
    gc.freeze()
    await service.set_serving(True)
    watch_task = asyncio.create_task(watchdog.run(), name="step-watchdog")
    await stop.wait()
    watch_task.cancel()
    await service.stop()
    if connector is not None and store is not None:
        # Let snapshots already taken reach the store before the process exits.
        try:
            await asyncio.wait_for(connector.drain(), timeout=10)
        except TimeoutError:
            logger.warning("KV saves still running at shutdown were abandoned")
        await store.close()
