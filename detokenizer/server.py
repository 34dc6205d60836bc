"""detokenizer process: load the tokenizer, follow the scheduler, serve gateways."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvmesh.detokenizer.registry import DetokenizerTable
from kvmesh.detokenizer.request_tracing import DetokenizerRequestTraces
from kvmesh.detokenizer.service import DetokenizerEngine, DetokenizerServicer
from kvmesh.detokenizer.tokenizer_loader import load_tokenizer
from kvmesh.protos import detokenizer_pb2, detokenizer_pb2_grpc
from kvmesh.services.runtime.config import DetokenizerConfig
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import GrpcService
from kvmesh.services.runtime.metrics import start_metrics_server
from kvmesh.services.runtime.model_prep import resolve_model_path
from kvmesh.services.runtime.tracing import start_tracing

logger = logging.getLogger(__name__)


async def serve(config: DetokenizerConfig, stop: asyncio.Event) -> None:
    start_metrics_server(config, config.detokenizer_metrics_port)
    security = InternalSecurity.from_config(config)
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    tracing = start_tracing("detokenizer", config.otlp_traces_endpoint)
    engine = DetokenizerEngine(
        DetokenizerTable(tokenizer),
        config.scheduler_addr,
        security,
        DetokenizerRequestTraces(tracing) if tracing is not None else None,
    )
    service = GrpcService(
        "detokenizer",
        [detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name],
        access=security,
    )
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(
        DetokenizerServicer(engine), service.server
    )
    await service.start(config.bind_host, config.detokenizer_port)
    # Ready only while subscribed to the scheduler: without it no output flows.
    run_task = asyncio.create_task(engine.run(stop, service.set_serving), name="scheduler-follow")
    await stop.wait()
    await service.stop(grace=2.0)
    run_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run_task
    if tracing is not None:
        tracing.shutdown()
