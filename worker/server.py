"""worker process: the gRPC Worker service around a ModelRunner.

The scheduler holds one Execute stream open and sends one StepRequest per
engine step. Each step runs on a dedicated thread so that the event loop keeps
answering health checks and GetInfo while a forward pass runs (torch releases
the GIL inside its kernels). A pipeline-parallel driver with overlap keeps up
to one step per stage begun: it begins each step as it arrives and finishes
the oldest once the last stage has handed it back (or the pipeline is full),
so that stage 0 runs step n+1 while later stages run step n.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter, Gauge, Histogram

from kvmesh.kernels import batch_invariant, kv_quant
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import worker_pb2, worker_pb2_grpc
from kvmesh.services.contracts.errors import InvalidRequestError, UnavailableError
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.contracts.step_codec import (
    model_runner_output_to_proto,
    scheduler_output_from_proto,
    structured_output_from_proto,
)
from kvmesh.services.contracts.step_deadline import StepDeadline, StepDeadlinePolicy
from kvmesh.services.runtime.config import WorkerConfig
from kvmesh.services.runtime.config.process import BATCH_INVARIANT
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import GrpcService
from kvmesh.services.runtime.metrics import start_metrics_server
from kvmesh.services.runtime.tracing import start_tracing
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.gguf_config import prepare_model_folder
from kvmesh.worker.kv_connector import KVBlockStore, KVConnectorWorker
from kvmesh.worker.kv_layout import worker_kv_layout
from kvmesh.worker.kvstore_blocks import KVStoreBlocks
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.registry import check_model
from kvmesh.worker.parallel.collectives import Collectives
from kvmesh.worker.parallel.driver import StepBroadcaster
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.rank_service import FATAL_EXIT_CODE, connect_ranks, serve_rank
from kvmesh.worker.parallel.replica_kv_connector import ReplicaKVConnector
from kvmesh.worker.pooling_runner import (
    PoolingRunner,
    checkpoint_architecture,
    is_pooling_checkpoint,
)
from kvmesh.worker.request_tracing import WorkerRequestTraces
from kvmesh.worker.runner_choice import RunnerChoice, choose_runner
from kvmesh.worker.step_budget import preferred_step_tokens
from kvmesh.worker.step_in_flight import StepInFlight
from kvmesh.worker.step_watchdog import StepWatchdog

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STEP_SECONDS = Histogram(
    "kvmesh:worker_step_seconds",
    "time to execute one engine step (input prep, forward, sampling)",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24),
)
_TOKENS = Counter("kvmesh:worker_tokens_computed_total", "tokens run through the model")
_BATCH = Gauge("kvmesh:worker_batch_size", "requests in the last step")
_KV_BLOCKS = Gauge("kvmesh:worker_num_kv_blocks", "KV cache blocks allocated")
_DTYPE = Gauge("kvmesh:worker_dtype_info", "1 for the model's compute dtype", ["dtype"])


@dataclass
class _BegunStep:
    """A step the driver began and has not answered yet."""

    step: StepInFlight
    scheduler_output: SchedulerOutput
    started: float
    # Resolves once finishing would not wait for a later stage.
    finishable: asyncio.Future[None]


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, watchdog: StepWatchdog | None = None, traces: WorkerRequestTraces | None = None
    ) -> None:
        # Set by attach() once the weights are loaded; until then every call
        # answers UNAVAILABLE.
        self.runner: ModelRunner | PoolingRunner | None = None
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
        # Each traced request's span (--otlp-traces-endpoint; None: off).
        self.traces = traces
        # Set when this worker drives a tensor/pipeline-parallel replica.
        self.broadcaster: StepBroadcaster | None = None
        # When the other ranks last heard from this one (monotonic seconds).
        self._last_broadcast = time.monotonic()
        # Steps the driver keeps begun at once (pipeline overlap: one per stage).
        self.max_steps_begun = 1
        # Waits for the last stage's output of the oldest begun step, off the step thread.
        self._arrivals = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-arrival")

    def attach(
        self,
        runner: ModelRunner | PoolingRunner,
        info: worker_pb2.WorkerInfo,
        broadcaster: StepBroadcaster | None = None,
        max_steps_begun: int = 1,
    ) -> None:
        self.runner, self.info, self.broadcaster = runner, info, broadcaster
        self.max_steps_begun = max_steps_begun if broadcaster is not None else 1

    def _run_step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        start = time.perf_counter()
        scheduler_output = scheduler_output_from_proto(request)
        if self.broadcaster is None:
            output = self.runner.execute_model(scheduler_output)
        else:
            output = self._with_ranks(self.broadcaster.execute, request, scheduler_output)
        return self._step_result(scheduler_output, output, start)

    def _step_result(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, start: float
    ) -> worker_pb2.StepResult:
        elapsed = time.perf_counter() - start
        _STEP_SECONDS.observe(elapsed)
        _TOKENS.inc(scheduler_output.total_num_scheduled_tokens)
        _BATCH.set(len(scheduler_output.num_scheduled_tokens))
        if self.traces is not None:
            self.traces.on_step(scheduler_output, elapsed)
        return model_runner_output_to_proto(output, execute_seconds=elapsed)

    def _with_ranks(self, call: Callable[..., T], *args: Any) -> T:
        """Run a call that involves every rank; if it fails, exit at once.

        A peer rank died, hung past the collective timeout, or this rank failed
        mid-step: the ranks are out of step, so this one exits and the launcher
        restarts the replica as a whole (the scheduler sees the stream end and
        fails its requests).
        """
        try:
            result = call(*args)
        except Exception:
            logger.exception("a call across the replica's ranks failed; exiting")
            os._exit(FATAL_EXIT_CODE)
        self._last_broadcast = time.monotonic()
        return result

    async def keep_ranks_alive(self, period_s: float) -> None:
        """While the replica idles, tell the other ranks so every ``period_s``: they
        wait for the next step in a collective, which would time out otherwise."""
        assert self.broadcaster is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period_s)
            if time.monotonic() - self._last_broadcast >= period_s:
                await loop.run_in_executor(
                    self.executor, self._with_ranks, self.broadcaster.keep_alive
                )

    def _timed(self, num_tokens: int) -> contextlib.AbstractContextManager[None]:
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.step(num_tokens)

    async def _pipelined(
        self, request_iterator: AsyncIterator[worker_pb2.StepRequest]
    ) -> AsyncIterator[worker_pb2.StepResult]:
        """The driver's steps with pipeline overlap: begin each step as it arrives,
        up to ``max_steps_begun``; finish the oldest when the pipeline is full, when
        the next step needs its tokens, or when the last stage handed it back
        before another step arrived. Results go out in step order."""
        loop = asyncio.get_running_loop()
        broadcaster = self.broadcaster
        assert broadcaster is not None and self.runner is not None
        arrived: asyncio.Queue[worker_pb2.StepRequest | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await arrived.put(request)
            finally:
                await arrived.put(None)

        reader = asyncio.create_task(read())
        begun: deque[_BegunStep] = deque()

        async def finish_oldest() -> worker_pb2.StepResult:
            oldest = begun.popleft()
            oldest.finishable.cancel()
            with self._timed(oldest.scheduler_output.total_num_scheduled_tokens):
                output = await loop.run_in_executor(
                    self.executor, self._with_ranks, broadcaster.finish, oldest.step
                )
            return self._step_result(oldest.scheduler_output, output, oldest.started)

        next_request: asyncio.Future[worker_pb2.StepRequest | None] | None = None
        try:
            while True:
                if len(begun) >= self.max_steps_begun:
                    yield await finish_oldest()
                    continue
                if next_request is None:
                    next_request = asyncio.ensure_future(arrived.get())
                if begun:
                    await asyncio.wait(
                        {next_request, begun[0].finishable}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if not next_request.done():
                        yield await finish_oldest()
                        continue
                request = await next_request
                next_request = None
                if request is None:
                    break
                scheduler_output = scheduler_output_from_proto(request)
                while begun and self.runner.busy_with(scheduler_output):
                    yield await finish_oldest()  # its tokens are this step's input
                started = time.perf_counter()
                with self._timed(scheduler_output.total_num_scheduled_tokens):
                    begin = functools.partial(broadcaster.begin, request, scheduler_output)
                    step = await loop.run_in_executor(self.executor, self._with_ranks, begin)
                finishable = loop.run_in_executor(self._arrivals, step.wait_until_finishable)
                begun.append(_BegunStep(step, scheduler_output, started, finishable))
        finally:
            reader.cancel()
            if next_request is not None:
                next_request.cancel()
            while begun:  # every rank must finish what it began before a reset
                await finish_oldest()

    async def _back_to_back(
        self, request_iterator: AsyncIterator[worker_pb2.StepRequest]
    ) -> AsyncIterator[worker_pb2.StepResult]:
        """The driver's steps, each begun by the step thread the moment the one
        before it ends: a reader task hands arrived requests over through a
        thread-safe queue, and results come back through the event loop, which
        is off the critical path. (Awaiting each step in the loop, then reading
        the next request, left the worker idle ~0.7-1.5 ms per step on a busy
        2-core box: 8% of a batch-1 decode; docs/performance.md, "back to back".)"""
        loop = asyncio.get_running_loop()
        arrived: queue.SimpleQueue[worker_pb2.StepRequest | None] = queue.SimpleQueue()
        results: asyncio.Queue[worker_pb2.StepResult | BaseException | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    arrived.put(request)
            finally:
                arrived.put(None)

        def run_steps() -> None:
            try:
                while (request := arrived.get()) is not None:
                    with self._timed(sum(request.num_scheduled_tokens)):
                        result = self._run_step(request)
                    loop.call_soon_threadsafe(results.put_nowait, result)
            except BaseException as exc:  # handed to the stream, which fails with it
                loop.call_soon_threadsafe(results.put_nowait, exc)
                return
            loop.call_soon_threadsafe(results.put_nowait, None)

        reader = asyncio.create_task(read())
        stepping = loop.run_in_executor(self.executor, run_steps)
        try:
            while (item := await results.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self.traces is not None:
                # First, before any await, as in Execute: a stream cancelled at
                # shutdown may get no further before the spans are flushed.
                self.traces.on_detached()
            reader.cancel()
            arrived.put(None)  # the step thread stops after the step it runs, if any
            # run_steps hands every error to `results`, so only a cancellation of
            # this stream can end the wait: the runner's reset below still needs
            # the step thread free.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(stepping)

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
            if self.max_steps_begun > 1:
                # Closed here, not by the collector: its begun steps finish before the reset.
                async with contextlib.aclosing(self._pipelined(request_iterator)) as results:
                    async for result in results:
                        yield result
                return
            async with contextlib.aclosing(self._back_to_back(request_iterator)) as results:
                async for result in results:
                    yield result
        finally:
            self._stream_open = False
            if self.traces is not None:
                # First, before any await: a cancelled stream may get no further.
                self.traces.on_detached()
            # A new scheduler starts from an empty batch (on every rank).
            if self.broadcaster is not None:
                await loop.run_in_executor(self.executor, self._with_ranks, self.broadcaster.reset)
            else:
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


def decoder_model_config(config: WorkerConfig, path: str | Path) -> ModelConfig:
    """The decoder checkpoint's ModelConfig under the worker's --dtype,
    --max-model-len, --device and --quantization, for generation and for a
    converted pooling model alike; an unknown architecture or config feature is
    refused here, before anything is allocated."""
    model_config = ModelConfig.from_pretrained(
        path,
        dtype=config.dtype,
        max_model_len=config.max_model_len or None,
        device=config.device,
        quantization=config.quantization or None,
    )
    check_model(model_config)
    return model_config


def build_pooling_runner(
    config: WorkerConfig, path: Path, choice: RunnerChoice | None = None
) -> tuple[PoolingRunner, worker_pb2.WorkerInfo]:
    """The pooling runner, no KV cache (worker/pooling_runner.py): an encoder
    checkpoint, or a generation checkpoint converted (``choice``: --runner
    pooling / --convert), which loads as generation does (--dtype, --quantization)."""
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        raise ValueError("tensor/pipeline parallelism is not implemented for pooling models")
    if config.enable_lora:
        raise ValueError("LoRA is not implemented for pooling models")
    if kv_quant.resolve(config.kv_cache_dtype) is not None:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype} is for generation: a pooling model "
            "keeps no KV cache between steps (leave it auto)"
        )
    if choice is not None and choice.pools_decoder:
        model_config = decoder_model_config(config, path)
        runner = PoolingRunner(
            path,
            num_threads=config.num_threads or None,
            decoder=model_config,
            convert=choice.convert,
            hf_overrides=choice.hf_overrides,
        )
        attention_backend = runner.decoder.backend.name if runner.decoder else ""
        quantization = model_config.weights_description
        weight_bytes = runner.decoder.model.resident_weight_bytes() if runner.decoder else 0
    else:
        if config.quantization and config.device != "cpu":
            raise ValueError("--quantization runs on CPU only")
        model_config = ModelConfig.from_pretrained(path, dtype=config.dtype, device=config.device)
        runner = PoolingRunner(
            path,
            dtype=model_config.dtype,
            max_model_len=config.max_model_len or None,
            num_threads=config.num_threads or None,
            quantization=config.quantization,
        )
        attention_backend, quantization, weight_bytes = "sdpa-packed", config.quantization, 0
    pooling = runner.info
    info = worker_pb2.WorkerInfo(
        model_name=config.served_model_name or Path(path).name,
        num_kv_blocks=0,
        block_size=config.block_size,
        max_model_len=pooling.max_model_len,
        vocab_size=runner.vocab_size,
        attention_backend=attention_backend,
        device=config.device,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        dtype=str(model_config.dtype).removeprefix("torch."),
        dtype_reason=model_config.dtype_reason,
        quantization=quantization,
        step_token_budget=preferred_step_tokens(config.device, model_config.dtype),
        runner="pooling",
        pooling_tasks=list(pooling.tasks),
        embedding_dim=pooling.embedding_dim,
        matryoshka_dimensions=list(pooling.matryoshka_dimensions),
        labels=list(pooling.labels),
        weight_bytes=weight_bytes,
    )
    return runner, info


def build_runner(
    config: WorkerConfig, collectives: Collectives | None = None
) -> tuple[ModelRunner | PoolingRunner, worker_pb2.WorkerInfo]:
    path = prepare_model_folder(config.model)
    # Checks --runner / --convert against the architecture, for encoders too.
    choice = choose_runner(
        checkpoint_architecture(path), config.runner, config.convert, config.hf_overrides
    )
    if is_pooling_checkpoint(path):
        return build_pooling_runner(config, Path(path))
    if choice.runner == "pooling":
        return build_pooling_runner(config, Path(path), choice)
    model_config = decoder_model_config(config, path)
    cache_config = CacheConfig(
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or None,
        kv_cache_memory_bytes=None if config.num_kv_blocks else config.kv_cache_memory,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    # Before the runner: its attention backend is chosen by the mode.
    batch_invariant.enable(config.batch_invariant or BATCH_INVARIANT.get(), config.device)
    runner = ModelRunner(
        model_config,
        cache_config,
        # A parallel rank's own accelerator (cuda:<rank>), as it joined with.
        device=str(collectives.device) if collectives is not None else config.device,
        attention_backend=config.attention_backend or None,
        num_threads=config.num_threads or None,
        collectives=collectives,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
    )
    info = worker_pb2.WorkerInfo(
        # A .gguf file's name, not its cache folder's.
        model_name=config.served_model_name
        or (Path(model_config.gguf_file).stem if model_config.gguf_file else Path(path).name),
        num_kv_blocks=runner.num_kv_blocks,
        block_size=config.block_size,
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=list(model_config.eos_token_ids),
        attention_backend=runner.attention_backend_name,
        device=config.device,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        pipeline_overlap=config.pipeline_overlap and config.pipeline_parallel_size > 1,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        dtype=str(model_config.dtype).removeprefix("torch."),
        dtype_reason=model_config.dtype_reason,
        quantization=model_config.weights_description,
        step_token_budget=preferred_step_tokens(config.device, model_config.dtype),
        runner="generate",
        weight_bytes=runner.model.resident_weight_bytes(),
        batch_invariant=batch_invariant.enabled(),
        # The scheduler does its block arithmetic per group (0: full attention).
        kv_cache_group_windows=[g.sliding_window or 0 for g in runner.kv_cache_groups],
    )
    return runner, info


def runner_kv_layout(runner: ModelRunner, info: worker_pb2.WorkerInfo) -> KVLayout:
    """The layout of the runner's KV blocks, named by the served model name: under
    tensor/pipeline parallelism, this rank's shard (its TP rank and size, its layers)."""
    model, plan = runner.model_config, runner.plan
    return worker_kv_layout(
        info.model_name,
        runner.cache_config.kv_format or model.dtype,
        info.block_size,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        tp_rank=plan.tp_rank,
        tp_size=plan.tp_size,
        layers=plan.layers,
    )


def attach_kv_connector(
    runner: ModelRunner,
    info: worker_pb2.WorkerInfo,
    store: KVBlockStore,
    layout: KVLayout,
    loop: asyncio.AbstractEventLoop,
) -> KVConnectorWorker:
    """Give the runner a connector to ``store`` and publish its layout in ``info``."""
    windows = [g.sliding_window for g in runner.kv_cache_groups]
    if windows != [None]:
        # A block of the store is every layer's page under one id; with
        # KV-cache groups a request's pages sit under one id per group.
        raise ValueError(
            "KV offload and prefill/decode transfer (--kv-offload) do not move sliding-window "
            f"KV caches yet (this model's KV-cache group windows: {windows}); turn it off"
        )
    connector = KVConnectorWorker(runner.kv_caches, store, loop)
    # A parallel rank reports a transfer only once every rank has done its shard.
    runner.kv_connector = (
        ReplicaKVConnector(connector, runner.collectives)
        if runner.collectives is not None and runner.layout.is_parallel
        else connector
    )
    info.kv_layout.CopyFrom(layout.to_proto())
    logger.info("KV offload on: %d-byte blocks, layout %s", connector.block_bytes, layout)
    return connector


async def connect_kv_offload(
    config: WorkerConfig, runner: ModelRunner, info: worker_pb2.WorkerInfo
) -> tuple[KVStoreBlocks, KVConnectorWorker]:
    """The store client under this rank's layout and the runner's connector to it."""
    layout = runner_kv_layout(runner, info)
    security = InternalSecurity.from_config(config)
    store = KVStoreBlocks(KVStoreClient(config.kvstore_addr, security=security), layout)
    loop = asyncio.get_running_loop()
    return store, attach_kv_connector(runner, info, store, layout, loop)


async def serve(config: WorkerConfig, stop: asyncio.Event) -> None:
    layout = RankLayout(config.tensor_parallel_size, config.pipeline_parallel_size, config.rank)
    if not layout.is_driver:
        await serve_rank(config, layout, stop, build_runner, connect_kv_offload)
        return
    start_metrics_server(config, config.worker_metrics_port)
    tracing = start_tracing("worker", config.otlp_traces_endpoint)
    security = InternalSecurity.from_config(config)
    service = GrpcService(
        "worker", [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name], access=security
    )
    watchdog = StepWatchdog(
        StepDeadline(StepDeadlinePolicy.from_options(config)), service.set_alive_and_ready
    )
    servicer = WorkerServicer(
        watchdog, WorkerRequestTraces(tracing) if tracing is not None else None
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, service.server)
    # Listen (NOT_SERVING) before loading so that health checks answer while
    # the weights load; flip to SERVING once the model is ready.
    await service.start(config.bind_host, config.worker_port)
    loop = asyncio.get_running_loop()
    collectives = (
        await loop.run_in_executor(servicer.executor, connect_ranks, config, layout)
        if layout.is_parallel
        else None
    )
    runner, info = await loop.run_in_executor(servicer.executor, build_runner, config, collectives)
    broadcaster = StepBroadcaster(runner, collectives) if collectives is not None else None
    _KV_BLOCKS.set(info.num_kv_blocks)
    _DTYPE.labels(info.dtype).set(1)
    logger.info(
        "model %s loaded: %d KV blocks of %d tokens, max_model_len %d, attention %s, dtype %s "
        "(%s), weights %s",
        info.model_name,
        info.num_kv_blocks,
        info.block_size,
        info.max_model_len,
        info.attention_backend,
        info.dtype,
        info.dtype_reason,
        info.quantization or "as in the checkpoint",
    )
    store: KVStoreBlocks | None = None
    connector: KVConnectorWorker | None = None
    if config.kv_offload and isinstance(runner, ModelRunner):
        store, connector = await connect_kv_offload(config, runner, info)
    # Pipeline overlap: one begun step per stage (the scheduler sends as many).
    max_steps_begun = config.pipeline_parallel_size if info.pipeline_overlap else 1
    if config.pipeline_parallel_size > 1:
        logger.info("pipeline overlap %s", "on" if info.pipeline_overlap else "off")
    servicer.attach(runner, info, broadcaster, max_steps_begun)
    # Everything allocated so far (modules, weights' Python wrappers, protobuf
    # descriptors) lives for the whole process: move it out of the collector's
    # generations, so that a collection during a step scans only per-step garbage.
    gc.collect()
    gc.freeze()
    await service.set_serving(True)
    watch_task = asyncio.create_task(watchdog.run(), name="step-watchdog")
    keep_alive_task = (
        asyncio.create_task(
            servicer.keep_ranks_alive(config.dist_timeout_s / 4), name="rank-keep-alive"
        )
        if broadcaster is not None
        else None
    )
    await stop.wait()
    watch_task.cancel()
    if keep_alive_task is not None:
        keep_alive_task.cancel()
    await service.stop()
    if broadcaster is not None:
        # The other ranks exit when told; one that died already leaves this
        # broadcast waiting, so it gets a bounded time.
        stopping = loop.run_in_executor(servicer.executor, broadcaster.stop)
        try:
            await asyncio.wait_for(stopping, timeout=10)
        except (TimeoutError, RuntimeError) as exc:
            logger.warning("could not tell every rank to stop: %s", exc)
    if tracing is not None:
        tracing.shutdown()
    if connector is not None and store is not None:
        # Let snapshots already taken reach the store before the process exits.
        try:
            await asyncio.wait_for(connector.drain(), timeout=10)
        except TimeoutError:
            logger.warning("KV saves still running at shutdown were abandoned")
        await store.close()
