"""``python -m kvmesh.services.runtime.healthcheck`` against a real gRPC health server and a
real HTTP server.

The checks run as subprocesses, exactly as Docker runs them, so the exit
status is what is asserted: 0 only for SERVING / HTTP 200.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.services.runtime.healthcheck import Endpoint, running_service, service_endpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def run_healthcheck(*args: str, env: dict[str, str] | None = None) -> int:
    child_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvmesh.services.runtime.healthcheck",
        "--timeout",
        "2",
        *args,
        cwd=REPO_ROOT,
        env=child_env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(process.wait(), timeout=30)


class HealthServer:
    def __init__(self, server: grpc.aio.Server, servicer: health.aio.HealthServicer, port: int):
        self.server = server
        self.servicer = servicer
        self.port = port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# The server must live on the test's own loop (fixtures default to the session loop).
@pytest_asyncio.fixture(loop_scope="function")
async def health_server() -> AsyncIterator[HealthServer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield HealthServer(server, servicer, port)
    finally:
        await server.stop(0)


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    """/status/NNN answers NNN; everything else 404."""

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        code = int(parts[1]) if len(parts) == 2 and parts[0] == "status" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_base_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_grpc_exit_status_follows_serving_status(health_server: HealthServer) -> None:
    await health_server.servicer.set("", NOT_SERVING)
    assert await run_healthcheck("grpc", health_server.address) == 1
    await health_server.servicer.set("", SERVING)
    assert await run_healthcheck("grpc", health_server.address) == 0


async def test_grpc_named_service(health_server: HealthServer) -> None:
    await health_server.servicer.set("", SERVING)
    await health_server.servicer.set("kvmesh.v1.Worker", SERVING)
    codes = await asyncio.gather(
        run_healthcheck("grpc", health_server.address, "--service", "kvmesh.v1.Worker"),
        # A service the server does not know answers NOT_FOUND: unhealthy.
        run_healthcheck("grpc", health_server.address, "--service", "kvmesh.v1.Nope"),
    )
    assert codes == [0, 1]


async def test_grpc_nothing_listening_is_unhealthy() -> None:
    assert await run_healthcheck("grpc", f"127.0.0.1:{_unused_port()}") == 1


async def test_grpc_server_in_graceful_shutdown_is_unhealthy(health_server: HealthServer) -> None:
    await health_server.servicer.set("", SERVING)
    await health_server.servicer.enter_graceful_shutdown()
    assert await run_healthcheck("grpc", health_server.address) == 1


async def test_http_exit_status_is_zero_only_for_200(http_base_url: str) -> None:
    codes = await asyncio.gather(
        run_healthcheck("http", f"{http_base_url}/status/200"),
        run_healthcheck("http", f"{http_base_url}/status/503"),
        run_healthcheck("http", f"{http_base_url}/status/204"),
        run_healthcheck("http", f"{http_base_url}/elsewhere"),
        run_healthcheck("http", f"http://127.0.0.1:{_unused_port()}/ready"),
    )
    assert codes == [0, 1, 1, 1, 1]


async def test_service_mode_reads_the_port_from_kvmesh_env(health_server: HealthServer) -> None:
    await health_server.servicer.set("", SERVING)
    env = {"KVMESH_KVSTORE_PORT": str(health_server.port), "KVMESH_BIND_HOST": "0.0.0.0"}
    assert await run_healthcheck("service", "kvstore", env=env) == 0
    # Same server, but the check is told the worker's (unused) port: unhealthy.
    env = {"KVMESH_WORKER_PORT": str(_unused_port())}
    assert await run_healthcheck("service", "worker", env=env) == 1


def test_service_endpoint_defaults_match_the_documented_ports() -> None:
    assert service_endpoint("worker", {}) == Endpoint("grpc", "127.0.0.1:50053")
    assert service_endpoint("kvstore", {}) == Endpoint("grpc", "127.0.0.1:50055")
    assert service_endpoint("gateway", {}) == Endpoint("http", "http://127.0.0.1:8000/ready")


def test_service_endpoint_connects_to_loopback_when_bound_to_all_interfaces() -> None:
    env = {"KVMESH_BIND_HOST": "0.0.0.0", "KVMESH_SCHEDULER_PORT": "6001"}
    assert service_endpoint("scheduler", env) == Endpoint("grpc", "127.0.0.1:6001")
    env = {"KVMESH_BIND_HOST": "10.1.2.3", "KVMESH_HTTP_PORT": "8080"}
    assert service_endpoint("gateway", env) == Endpoint("http", "http://10.1.2.3:8080/ready")


def test_service_endpoint_dials_as_the_service_listens_under_tls() -> None:
    tls = {
        "KVMESH_INTERNAL_TLS_CERTFILE": "/tls/tls.crt",
        "KVMESH_INTERNAL_TLS_KEYFILE": "/tls/tls.key",
        "KVMESH_INTERNAL_TLS_CA_CERTS": "/tls/ca.crt",
    }
    worker = service_endpoint("worker", tls)
    assert worker.security.mutual_tls and worker.security.certfile == "/tls/tls.crt"
    public = {"KVMESH_SSL_CERTFILE": "/p/c.pem", "KVMESH_SSL_KEYFILE": "/p/k.pem"}
    assert service_endpoint("gateway", public).target == "https://127.0.0.1:8000/ready"


def test_service_endpoint_rejects_unknown_service() -> None:
    with pytest.raises(ValueError, match="unknown service"):
        service_endpoint("frontend", {})


def _fake_proc(root: Path, cmdlines: dict[int, list[str]]) -> Path:
    for pid, argv in cmdlines.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()  # non-numeric entries are not processes
    return root


def test_running_service_finds_the_serve_command(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        {
            1: ["/sbin/docker-init", "--", "kvmesh", "serve", "detokenizer"],
            7: ["/opt/venv/bin/python", "/opt/venv/bin/kvmesh", "serve", "detokenizer"],
            30: ["python", "-m", "kvmesh.services.runtime.healthcheck", "self"],
        },
    )
    assert running_service(proc) == "detokenizer"


def test_running_service_ignores_unrelated_processes(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {1: ["sleep", "serve"], 2: ["kvmesh", "serve", "frontend"]})
    assert running_service(proc) is None
