"""gRPC servers and channels of every service: the one place a port or a channel is opened.

Every server gets: its port's access checks (``services/runtime/grpc_security.py``:
the internal token and mutual TLS, or the gateway's public TLS), an
error-boundary interceptor (exceptions become status codes, never a crashed
handler), standard health checking (``grpc.health.v1``), and reflection, so
``grpcurl`` and load balancers work against any service. Every channel
presents the stack's credentials. A test keeps ports and channels from being
opened anywhere else, so no call can bypass them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.services.contracts.errors import reported_error
from kvmesh.services.runtime.grpc_handlers import same_shape_handler
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity, PortAccess

logger = logging.getLogger(__name__)

# Step messages carry token ids for a whole batch and KV blocks carry raw
# bytes: the 4 MiB default is too small for either.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer (request migration waits for it) is found within ~2 s,
    # not after gRPC's default backoff, which grows to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Liveness, kept apart from readiness ('' and each named service): SERVING from
# the moment the server starts (a worker loading its weights is alive), NOT_SERVING
# only while the service knows it is stuck (a worker step past its deadline).
# Orchestrators restart on it: deploy/k8s/base/engine.yaml probes it, and so does
# ``kvmesh up``'s launcher.
LIVENESS_SERVICE = "kvmesh.Liveness"
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


async def _report(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """The one exception -> status conversion of every kvmesh gRPC server."""
    error = reported_error(exc, method)  # a bug: traceback logged, reported as INTERNAL
    if error is exc:  # raised on purpose: one line says why
        logger.info("%s failed with %s: %s", method, error.kind.name, error.details)
    await context.abort(error.kind.grpc_code, error.details)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _report(exc, context, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _report(exc, context, method)

    return wrapped


class ErrorBoundaryInterceptor(grpc.aio.ServerInterceptor):
    """Map exceptions escaping a handler to status codes (via contracts ``ErrorKind``)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return same_shape_handler(handler, handler_call_details.method, _wrap_unary, _wrap_stream)


def _health_status(up: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
    )


class GrpcService:
    """A grpc.aio server with health and reflection, for one kvmesh service."""

    def __init__(
        self,
        name: str,
        service_full_names: Iterable[str],
        max_receive_message_bytes: int = MAX_MESSAGE_BYTES,
        access: PortAccess = NO_INTERNAL_AUTH,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        """``max_receive_message_bytes``: the largest message a caller may send; a
        public port takes far less than the internal ones' step and KV messages.
        ``access``: what callers must present (the default: nothing, plaintext).
        ``interceptors`` run outside the error boundary (a tracing span then
        sees the status the boundary reports)."""
        self.name = name
        self._credentials = access.server_credentials()
        receive_limit = "grpc.max_receive_message_length"
        options = [
            *(option for option in SERVER_OPTIONS if option[0] != receive_limit),
            (receive_limit, max_receive_message_bytes),
        ]
        self.server = grpc.aio.server(
            interceptors=[*interceptors, *access.server_interceptors(), ErrorBoundaryInterceptor()],
            options=options,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_full_names)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        if self._credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self._credentials)
        if self.port == 0:
            raise OSError(f"{self.name}: could not bind {host}:{port}")
        await self.server.start()
        await self.set_serving(False)
        await self.set_alive(True)
        logger.info("%s listening on %s:%d", self.name, host, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Flip readiness for the whole server ('') and each named service."""
        for service in ["", *self._service_names]:
            await self.health.set(service, _health_status(serving))

    async def set_alive(self, alive: bool) -> None:
        """Flip liveness (``LIVENESS_SERVICE``); NOT_SERVING asks for a restart."""
        await self.health.set(LIVENESS_SERVICE, _health_status(alive))

    async def set_alive_and_ready(self, up: bool) -> None:
        """Both at once: a service stuck in its work is neither (a worker's hung step:
        a scheduler must not attach to it again until it is back)."""
        await self.set_alive(up)
        await self.set_serving(up)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def internal_channel(
    address: str,
    security: InternalSecurity,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to another kvmesh service, presenting ``security``'s token and
    certificate; ``interceptors`` (tracing) run before the token's."""
    options = [*CHANNEL_OPTIONS, *security.channel_options()]
    all_interceptors = [*interceptors, *security.client_interceptors()]
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(
            address, options=options, interceptors=all_interceptors or None
        )
    return grpc.aio.secure_channel(
        address, credentials, options=options, interceptors=all_interceptors or None
    )


def probe_channel(
    address: str, security: InternalSecurity, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A blocking channel for health probes (launcher, container checks): no token
    (health checks need none), but the certificate where internal TLS is on."""
    options = [*(options or []), *security.channel_options()]
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def public_channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    """A blocking channel to a gateway's public gRPC API, as an outside client
    (``kvmesh.Client``) dials it: TLS with ``credentials``, plaintext without;
    the API key travels as call metadata, not as a channel interceptor."""
    if credentials is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def public_aio_channel(
    target: str, credentials: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    """``public_channel`` for asyncio clients (``kvmesh.AsyncClient``)."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


async def wait_until_serving(
    address: str, timeout: float, security: InternalSecurity, service: str = ""
) -> None:
    """Poll the standard health service until it says SERVING (or time out)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    last_error = "no answer"
    async with internal_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as e:
                last_error = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout:.0f}s ({last_error})")
