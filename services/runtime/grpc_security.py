"""Who may call a kvmesh gRPC port, and what a caller presents.

Two kinds of port, two policies:

- **Internal ports** (scheduler, worker, detokenizer, kvstore, and the
  scheduler's KVEvents stream): :class:`InternalSecurity`. A shared token
  (``--internal-auth-token``) that a server interceptor checks on every call
  and a client interceptor attaches to every call, and/or mutual TLS
  (``--internal-tls-*``): both sides present a certificate of the stack's CA.
  Either one keeps a process that is not part of the stack from submitting
  steps to a worker or reading a detokenizer's outputs; TLS also keeps the
  traffic private on a shared network.
- **The gateway's public gRPC port**: :class:`PublicTLS`, vLLM's ``--ssl-*``
  options (its callers are authenticated by ``--api-key``, not by the token).

``grpc.health.v1`` stays open without the token: kubelet's gRPC probes and
load balancers cannot send metadata, and the service tells only SERVING or
NOT_SERVING. (Under mutual TLS a probe needs a certificate all the same:
``python -m kvmesh.services.runtime.healthcheck`` presents the service's own.)

Servers and channels are built from these in ``services/runtime/grpc_server.py`` and
nowhere else (``tests/services/test_services_grpc_single_point.py``).
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvmesh.services.runtime.config import INTERNAL_TLS_SERVER_NAME, CommonConfig, GatewayConfig
from kvmesh.services.runtime.grpc_handlers import same_shape_handler

logger = logging.getLogger(__name__)

# The metadata key of the internal token (lower case, as gRPC requires).
TOKEN_METADATA_KEY = "kvmesh-internal-token"
# Methods callable without the token: health checks only (see the module docstring).
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


class PortAccess(Protocol):
    """What a server port requires of its callers."""

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of the port; None: plaintext."""
        ...

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Checks run on every call before its handler."""
        ...


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    # A coroutine serves every handler shape: gRPC accepts one for streamed
    # responses too (the reader/writer API), and abort ends the call first.
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal auth token")


def _refused(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    return _refuse


class TokenCheckInterceptor(grpc.aio.ServerInterceptor):
    """Refuse (UNAUTHENTICATED) every call but health checks that lacks the token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def _carries_token(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                text = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(text, self._token)  # no timing side channel
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (
            handler is None
            or method.startswith(OPEN_METHOD_PREFIX)
            or self._carries_token(handler_call_details.invocation_metadata)
        ):
            return handler
        logger.warning("refused %s: missing or wrong internal auth token", method)
        return same_shape_handler(handler, method, _refused, _refused)


class _AttachToken:
    """Adds the token to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_METADATA_KEY, token)

    async def _intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return await continuation(details._replace(metadata=metadata), request)


# One subclass per call shape: grpc.aio files an interceptor under the first
# shape it is an instance of, so one object cannot serve all four.
_TOKEN_INTERCEPTORS = [
    type(f"TokenFor{shape.__name__}", (_AttachToken, shape), {method: _AttachToken._intercept})
    for shape, method in (
        (grpc.aio.UnaryUnaryClientInterceptor, "intercept_unary_unary"),
        (grpc.aio.UnaryStreamClientInterceptor, "intercept_unary_stream"),
        (grpc.aio.StreamUnaryClientInterceptor, "intercept_stream_unary"),
        (grpc.aio.StreamStreamClientInterceptor, "intercept_stream_stream"),
    )
]


@dataclass(frozen=True)
class InternalSecurity:
    """How internal services authenticate each other; the default is open plaintext."""

    token: str = ""
    certfile: str = ""
    keyfile: str = ""
    ca_certs: str = ""
    # Checked in the server's certificate instead of the dialed host ('': the host).
    server_name: str = INTERNAL_TLS_SERVER_NAME

    @classmethod
    def from_config(cls, config: CommonConfig) -> InternalSecurity:
        return cls(
            token=config.internal_auth_token,
            certfile=config.internal_tls_certfile,
            keyfile=config.internal_tls_keyfile,
            ca_certs=config.internal_tls_ca_certs,
            server_name=config.internal_tls_server_name,
        )

    @property
    def mutual_tls(self) -> bool:
        return bool(self.certfile)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.mutual_tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.keyfile), _read(self.certfile))],
            root_certificates=_read(self.ca_certs),
            require_client_auth=True,
        )

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheckInterceptor(self.token)] if self.token else []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.mutual_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_certs),
            private_key=_read(self.keyfile),
            certificate_chain=_read(self.certfile),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.mutual_tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        if not self.token:
            return []
        return [interceptor(self.token) for interceptor in _TOKEN_INTERCEPTORS]


# Plaintext, no token: internal ports of a stack started with neither (and the
# in-process services of unit tests).
NO_INTERNAL_AUTH = InternalSecurity()


@dataclass(frozen=True)
class PublicTLS:
    """TLS of the gateway's public ports (HTTP and gRPC), with vLLM's option names."""

    certfile: str = ""
    keyfile: str = ""
    ca_certs: str = ""
    cert_reqs: int = ssl.CERT_NONE

    @classmethod
    def from_config(cls, config: GatewayConfig) -> PublicTLS:
        return cls(
            config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.certfile:
            return None
        # gRPC's Python API knows only "required" or not: "optional" (1) admits
        # the same callers as "none", so neither requires a client certificate.
        return grpc.ssl_server_credentials(
            [(_read(self.keyfile), _read(self.certfile))],
            root_certificates=_read(self.ca_certs) if self.ca_certs else None,
            require_client_auth=self.cert_reqs == ssl.CERT_REQUIRED,
        )

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return []  # callers are authenticated by --api-key, in the servicer

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's keyword arguments for the HTTP port (none: plaintext)."""
        if not self.certfile:
            return {}
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs or None,
            "ssl_cert_reqs": self.cert_reqs,
        }
