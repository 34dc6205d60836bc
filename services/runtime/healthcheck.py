"""Container health checks that need no extra binaries.

    python -m kvmesh.services.runtime.healthcheck grpc HOST:PORT [--service NAME]
    python -m kvmesh.services.runtime.healthcheck http URL
    python -m kvmesh.services.runtime.healthcheck service NAME   # that service's own endpoint
    python -m kvmesh.services.runtime.healthcheck self           # the service this container runs

The exit status is 0 only when the standard ``grpc.health.v1.Health`` service
answers SERVING, or the URL answers HTTP 200; anything else (NOT_SERVING, an
unknown service, a refused connection, a timeout, HTTP 503) exits 1, which is
what Docker's HEALTHCHECK and compose's ``healthcheck`` expect. The slim image
has neither curl nor grpc_health_probe, and Python with grpcio is already there.

``service`` and ``self`` dial the way the service listens: with its internal
certificate where ``--internal-tls-*`` is set (health checks need no token),
over https where the gateway has ``--ssl-certfile``.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.services.runtime.config import SERVICE_CONFIGS, config_from_namespace
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import probe_channel

DEFAULT_TIMEOUT_S = 3.0
# Health checks target the container itself: a proxy configured for outbound
# traffic (http_proxy and friends, honoured by urllib and grpc alike) must not
# swallow them.
# The container's own certificate need not name the probed host, and the probe
# sends nothing secret: https is not verified.
_UNVERIFIED_TLS = ssl.create_default_context()
_UNVERIFIED_TLS.check_hostname = False
_UNVERIFIED_TLS.verify_mode = ssl.CERT_NONE
_NO_PROXY_OPENER = urllib.request.build_opener(
    urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=_UNVERIFIED_TLS)
)
_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]
# Hosts a service may bind that are not addresses to connect to.
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class HealthResult:
    healthy: bool
    detail: str


@dataclass(frozen=True)
class Endpoint:
    """What to probe: ``kind`` is "grpc" (target is host:port) or "http" (target is a URL)."""

    kind: str
    target: str
    # How to dial a gRPC target (internal TLS); unused for http.
    security: InternalSecurity = NO_INTERNAL_AUTH


def check_grpc(
    address: str,
    service: str = "",
    timeout: float = DEFAULT_TIMEOUT_S,
    security: InternalSecurity = NO_INTERNAL_AUTH,
) -> HealthResult:
    """Ask ``address``'s standard health service whether ``service`` ('' = whole server) serves."""
    try:
        with probe_channel(address, security, _CHANNEL_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        name = code.name if code is not None else "ERROR"
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        return HealthResult(False, f"{address}: {name}: {details}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthResult(reply.status == health_pb2.HealthCheckResponse.SERVING, status)


def check_http(url: str, timeout: float = DEFAULT_TIMEOUT_S) -> HealthResult:
    """GET ``url``; healthy only on HTTP 200."""
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        return HealthResult(False, f"{url}: HTTP {e.code}")
    except (urllib.error.URLError, OSError) as e:
        return HealthResult(False, f"{url}: {e}")
    return HealthResult(status == 200, f"HTTP {status}")


def service_endpoint(service: str, environ: Mapping[str, str] | None = None) -> Endpoint:
    """The endpoint that says whether ``service`` is ready, from its config (flags aside).

    Ports come from the same ``KVMESH_*`` variables the service itself reads, so
    a container that moves a port keeps a working health check.
    """
    if service not in SERVICE_CONFIGS:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(SERVICE_CONFIGS)}")
    config = config_from_namespace(SERVICE_CONFIGS[service], argparse.Namespace(), environ)
    host = "127.0.0.1" if config.bind_host in _WILDCARD_HOSTS else config.bind_host
    if service == "gateway":
        # /ready, not /health: healthy means the gateway can reach its engine.
        scheme = "https" if config.ssl_certfile else "http"
        return Endpoint("http", f"{scheme}://{host}:{config.http_port}/ready")
    security = InternalSecurity.from_config(config)
    return Endpoint("grpc", f"{host}:{getattr(config, f'{service}_port')}", security)


def running_service(proc_root: Path = Path("/proc")) -> str | None:
    """The service named by a ``... serve NAME`` command line among this PID namespace's processes.

    Lets one image keep one HEALTHCHECK whichever service a container runs.
    """
    pids = sorted(int(p.name) for p in proc_root.iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            argv = (proc_root / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # the process ended while we looked
        words = [a.decode(errors="replace") for a in argv]
        for i, word in enumerate(words[:-1]):
            if word == "serve" and words[i + 1] in SERVICE_CONFIGS:
                return words[i + 1]
    return None


def check_endpoint(endpoint: Endpoint, timeout: float = DEFAULT_TIMEOUT_S) -> HealthResult:
    if endpoint.kind == "grpc":
        return check_grpc(endpoint.target, timeout=timeout, security=endpoint.security)
    return check_http(endpoint.target, timeout=timeout)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.services.runtime.healthcheck",
        description="Exit 0 when a kvmesh endpoint is healthy, 1 otherwise.",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    modes = parser.add_subparsers(dest="mode", required=True)
    grpc_mode = modes.add_parser("grpc", help="standard gRPC health check of HOST:PORT")
    grpc_mode.add_argument("address", help="HOST:PORT")
    grpc_mode.add_argument("--service", default="", help="service name ('' = whole server)")
    http_mode = modes.add_parser("http", help="GET a URL, healthy on HTTP 200")
    http_mode.add_argument("url")
    service_mode = modes.add_parser("service", help="a kvmesh service's own endpoint")
    service_mode.add_argument("name", choices=sorted(SERVICE_CONFIGS))
    modes.add_parser("self", help="the kvmesh service this container runs (`kvmesh serve NAME`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.mode == "grpc":
        result = check_grpc(args.address, args.service, args.timeout)
    elif args.mode == "http":
        result = check_http(args.url, args.timeout)
    else:
        name = args.name if args.mode == "service" else running_service()
        if name is None:
            print("no `serve NAME` process found", file=sys.stderr)
            return 1
        result = check_endpoint(service_endpoint(name), args.timeout)
    print(result.detail, file=sys.stdout if result.healthy else sys.stderr)
    return 0 if result.healthy else 1


if __name__ == "__main__":
    sys.exit(main())
