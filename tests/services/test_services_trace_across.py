"""One request, one connected trace across gateway, scheduler, worker and detokenizer.

The four real services run in this process (each its ``serve()``, on its own
ports, the default model in a small KV cache) with ``--otlp-traces-endpoint``
pointing at an OTLP/gRPC collector served by the test. A completion whose
call carries a W3C ``traceparent`` must come back as spans from all four
services, all in the caller's trace, each one's parent either the caller's
span or another span of the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry

from kvmesh.detokenizer.server import serve as serve_detokenizer
from kvmesh.gateway.server import serve as serve_gateway
from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.server import serve as serve_scheduler
from kvmesh.services.cli.local_stack import free_ports
from kvmesh.services.runtime.config import (
    DetokenizerConfig,
    GatewayConfig,
    SchedulerServiceConfig,
    WorkerConfig,
)
from kvmesh.services.runtime.model_prep import default_model_path, is_prepared
from kvmesh.worker.server import serve as serve_worker

pytestmark = pytest.mark.model

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
MAX_TOKENS = 4
MODEL_NAME = "traced"


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    span: trace_pb2.Span


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span with its service's name."""

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(
                    CollectedSpan(attributes["service.name"], s) for s in scope_spans.spans
                )
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def running_collector() -> Iterator[tuple[Collector, int]]:
    # A thread-pool server, not one on the test's loop: a service's shutdown
    # flushes its spans synchronously from that loop.
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    collector = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)


Serve = Callable[[object, asyncio.Event], Awaitable[None]]


def _stack(endpoint: str) -> list[tuple[Serve, object]]:
    """Each service's serve() and config, in start order, on free loopback ports."""
    ports = free_ports(9)
    worker, scheduler, detokenizer = (f"127.0.0.1:{p}" for p in ports[0:3])
    common = {"otlp_traces_endpoint": endpoint}
    return [
        (
            serve_worker,
            WorkerConfig(
                worker_port=ports[0], worker_metrics_port=ports[3], num_kv_blocks=64, **common
            ),
        ),
        (
            serve_scheduler,
            SchedulerServiceConfig(
                scheduler_port=ports[1],
                scheduler_metrics_port=ports[4],
                worker_addr=worker,
                **common,
            ),
        ),
        (
            serve_detokenizer,
            DetokenizerConfig(
                detokenizer_port=ports[2],
                detokenizer_metrics_port=ports[5],
                scheduler_addr=scheduler,
                **common,
            ),
        ),
        (
            serve_gateway,
            GatewayConfig(
                http_port=ports[6],
                grpc_port=ports[7],
                scheduler_addr=scheduler,
                detokenizer_addr=detokenizer,
                served_model_name=MODEL_NAME,
                **common,
            ),
        ),
    ]


async def _wait_ready(client: httpx.AsyncClient, tasks: list[asyncio.Task[None]]) -> None:
    for _ in range(600):
        for task in tasks:
            if task.done():
                task.result()  # a service that died: its error
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/ready")).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise TimeoutError("the stack did not become ready")


async def _one_traced_completion(endpoint: str) -> dict:
    stack = _stack(endpoint)
    stops = [asyncio.Event() for _ in stack]
    tasks = [
        asyncio.create_task(serve(config, stop))
        for (serve, config), stop in zip(stack, stops, strict=True)
    ]
    gateway_config = stack[-1][1]
    try:
        base = f"http://127.0.0.1:{gateway_config.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await _wait_ready(client, tasks)
            response = await client.post(
                "/v1/completions",
                # ignore_eos: the span counts below need every step (the
                # greedy text depends on the dtype --dtype auto picks here).
                json={
                    "model": MODEL_NAME,
                    "prompt": "The capital of France is",
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                },
                headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
            )
        assert response.status_code == 200, response.text
        return response.json()
    finally:
        # Downstream first, as an orchestrator would stop them; each flushes its spans.
        for stop, task in reversed(list(zip(stops, tasks, strict=True))):
            stop.set()
            await asyncio.wait_for(task, timeout=60)


@pytest.fixture(scope="module")
def collected() -> list[CollectedSpan]:
    if not is_prepared(default_model_path()):
        pytest.skip("the default model is not prepared (make install)")
    with running_collector() as (collector, port), pytest.MonkeyPatch.context() as patch:
        # Separate processes have separate registries; here the scheduler's and
        # the worker's connector counters would share the global one.
        patch.setattr(
            "kvmesh.scheduler.server.SchedulerMetrics",
            lambda model_name: SchedulerMetrics(model_name, registry=CollectorRegistry()),
        )
        body = asyncio.run(_one_traced_completion(f"http://127.0.0.1:{port}"))
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        return collector.spans


def _by_name(spans: list[CollectedSpan], name: str) -> list[CollectedSpan]:
    return [s for s in spans if s.span.name == name]


def test_every_service_adds_spans_to_the_callers_trace(collected: list[CollectedSpan]) -> None:
    assert {s.service for s in collected} >= {
        "kvmesh-gateway",
        "kvmesh-scheduler",
        "kvmesh-worker",
        "kvmesh-detokenizer",
    }
    assert {s.span.trace_id.hex() for s in collected} == {CLIENT_TRACE_ID}


def test_the_trace_is_connected(collected: list[CollectedSpan]) -> None:
    ids = {s.span.span_id for s in collected}
    for s in collected:
        parent = s.span.parent_span_id.hex()
        assert parent == CLIENT_SPAN_ID or s.span.parent_span_id in ids, (s.service, s.span.name)
    roots = [s for s in collected if s.span.parent_span_id.hex() == CLIENT_SPAN_ID]
    assert [(r.service, r.span.name) for r in roots] == [("kvmesh-gateway", "POST /v1/completions")]


def test_each_hop_hangs_under_the_one_that_sent_the_request(
    collected: list[CollectedSpan],
) -> None:
    def only(name: str, service: str | None = None) -> trace_pb2.Span:
        (found,) = [s.span for s in _by_name(collected, name) if service in (None, s.service)]
        return found

    http = only("POST /v1/completions")
    generate = only("gateway.generate")
    add_request = f"/{scheduler_pb2.DESCRIPTOR.services_by_name['Scheduler'].full_name}/AddRequest"
    add_client = only(add_request, "kvmesh-gateway")
    add_server = only(add_request, "kvmesh-scheduler")
    request = only("kvmesh.scheduler.request")
    assert only("tokenize").parent_span_id == http.span_id
    route = only("route")
    assert route.parent_span_id == http.span_id
    assert {a.key for a in route.attributes} >= {"kvmesh.replica", "kvmesh.routing_reason"}
    assert generate.parent_span_id == http.span_id
    assert add_client.parent_span_id == generate.span_id
    assert add_server.parent_span_id == add_client.span_id
    assert request.parent_span_id == add_server.span_id
    assert only("scheduler.queue").parent_span_id == request.span_id
    assert only("worker.request").parent_span_id == request.span_id
    assert only("detokenizer.request").parent_span_id == request.span_id
    # One event per step, in the scheduler and in the worker: prefill, then
    # one per token after the first.
    assert len([e for e in request.events if e.name == "scheduled"]) == MAX_TOKENS
    assert len([e for e in only("worker.request").events if e.name == "step"]) == MAX_TOKENS
