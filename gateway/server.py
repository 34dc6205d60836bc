"""gateway process: OpenAI HTTP API (uvicorn) and public gRPC API on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from kvmesh.gateway.admission import AdmissionGate
from kvmesh.gateway.engine.disaggregation import PrefillClient
from kvmesh.gateway.engine.grpc_client import GrpcEngineClient
from kvmesh.gateway.engine.routed_client import RoutedEngineClient
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.served_models import ServedModels, read_lora_request
from kvmesh.gateway.grpc.servicer import GenerationServicer
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.door import door_protocol
from kvmesh.gateway.openai.output_parsing import resolve_output_parsing
from kvmesh.gateway.responses.kvstore_store import KVStoreResponseStore
from kvmesh.gateway.responses.store import MemoryResponseStore, ResponseStore, ResponseStoreConfig
from kvmesh.gateway.routing.discovery import make_discovery
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tracing import TRACED_PUBLIC_METHODS, TRACED_SCHEDULER_METHODS
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.services.contracts.replica_set import ReplicaAddress
from kvmesh.services.runtime.config import GatewayConfig
from kvmesh.services.runtime.grpc_security import InternalSecurity, PublicTLS
from kvmesh.services.runtime.grpc_server import GrpcService
from kvmesh.services.runtime.metrics import start_metrics_server
from kvmesh.services.runtime.model_prep import resolve_model_path
from kvmesh.services.runtime.tracing import start_tracing

logger = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service runtime owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def served_models(config: GatewayConfig, served_name: str) -> ServedModels:
    """The base model and the ``--lora-modules`` adapters; a bad adapter stops the start."""
    models = ServedModels(served_name, lora_enabled=config.enable_lora)
    for name, path in config.lora_module_paths.items():
        models.add(read_lora_request(name, path))
    return models


def _response_store(config: GatewayConfig, security: InternalSecurity) -> ResponseStore:
    """Where /v1/responses are kept: the kvstore shared by the replicas, or this process."""
    store_config = ResponseStoreConfig.from_config(config)
    if config.responses_kvstore_addr:
        logger.info("responses kept in the kvstore at %s", config.responses_kvstore_addr)
        client = KVStoreClient(config.responses_kvstore_addr, security=security)
        return KVStoreResponseStore(client, store_config)
    return MemoryResponseStore(store_config)


async def serve(config: GatewayConfig, stop: asyncio.Event) -> None:
    model_path = resolve_model_path(config.model)
    tokenizer = Tokenizer.from_pretrained(model_path)
    output_parsing = resolve_output_parsing(config, tokenizer)
    security = InternalSecurity.from_config(config)
    tracing = start_tracing("gateway", config.otlp_traces_endpoint)
    scheduler_interceptors = (
        tracing.client_interceptors(TRACED_SCHEDULER_METHODS) if tracing is not None else ()
    )
    discovery = make_discovery(config)

    def replica_client(replica: ReplicaAddress) -> GrpcEngineClient:
        prefill = (
            PrefillClient(
                config.prefill_scheduler_addr,
                config.prefill_timeout_s,
                security,
                scheduler_interceptors,
            )
            if config.prefill_scheduler_addr
            else None
        )
        return GrpcEngineClient(
            replica.scheduler_addr,
            replica.detokenizer_addr,
            token_text=tokenizer.token_to_text,
            prefill=prefill,
            security=security,
            tracing=tracing,
            max_migrations=config.max_migrations,
            migration_timeout_s=config.migration_timeout_s,
        )

    engine = RoutedEngineClient(
        discovery,
        replica_client,
        config.routing_policy,
        config.replica_poll_period_s,
        config.routing_overlap_weight,
        security,
        tracing,
        wait_for_replica_s=config.migration_timeout_s,
    )
    logger.info(
        "engine replicas by %s discovery, routed by policy %s%s",
        config.replica_discovery,
        config.routing_policy,
        f"; prefills on {config.prefill_scheduler_addr}" if config.prefill_scheduler_addr else "",
    )
    stop_task = asyncio.create_task(stop.wait())
    start_task = asyncio.create_task(engine.start())
    await asyncio.wait({start_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        start_task.cancel()
        await engine.close()
        return
    start_task.result()

    served_name = config.served_model_name or engine.model_info.served_model_name
    limits = GatewayLimits.from_config(config)
    limit = config.max_inflight_requests or engine.model_info.capacity
    if not limit:
        raise RuntimeError("the scheduler reports no capacity; set --max-inflight-requests")
    admission = AdmissionGate(limit)
    logger.info("serving at most %d generation calls at once", admission.limit)
    public_tls = PublicTLS.from_config(config)
    grpc_service = GrpcService(
        "gateway",
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        max_receive_message_bytes=config.max_request_body_bytes,
        access=public_tls,
        interceptors=[tracing.server_interceptor(TRACED_PUBLIC_METHODS)]
        if tracing is not None
        else (),
    )
    # What both public surfaces (gRPC and HTTP) serve, and their shared bounds.
    surface = (engine, tokenizer, served_name)
    surface_options = {
        "api_key": config.api_key or None,
        "limits": limits,
        "admission": admission,
        "tracing": tracing,
    }
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(*surface, **surface_options),
        grpc_service.server,
    )
    await grpc_service.start(config.bind_host, config.grpc_port)
    await grpc_service.set_serving(True)

    # /metrics on the public HTTP port unless it has a port of its own (or none).
    metrics_on_http = config.expose_metrics and not config.gateway_metrics_port
    if config.gateway_metrics_port:
        start_metrics_server(config, config.gateway_metrics_port)
    response_store = _response_store(config, security)
    app = build_app(
        *surface,
        **surface_options,
        serve_metrics=metrics_on_http,
        models=served_models(config, served_name),
        output_parsing=output_parsing,
        response_store=response_store,
    )
    http = _EmbeddedUvicorn(
        uvicorn.Config(
            app,
            host=config.bind_host,
            port=config.http_port,
            log_level=config.log_level.lower(),
            access_log=False,
            # The C parser (a pinned dependency), never a silent fall-back to h11;
            # without tracing (whose spans cover refusals) a full gate answers
            # 429 from the protocol object, before any ASGI work (issue 43).
            http="httptools" if tracing is not None else door_protocol(admission, config.api_key),
            timeout_graceful_shutdown=5,
            # A burst past the accept queue is not refused but left to the
            # clients' SYN retries (issue 43: 429s up to 143 s late).
            backlog=config.http_backlog,
            **public_tls.uvicorn_options(),
        )
    )
    http_task = asyncio.create_task(http.serve(), name="http")
    scheme = "https" if config.ssl_certfile else "http"
    logger.info("OpenAI API on %s://%s:%d/v1", scheme, config.bind_host, config.http_port)
    await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    http.should_exit = True
    await http_task
    await grpc_service.stop(grace=2.0)
    await engine.close()
    await response_store.close()
    if tracing is not None:
        tracing.shutdown()
