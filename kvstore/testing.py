"""Test helpers: a settable clock, an in-process kvstore server, a throwaway redis-server.

For kvstore's own tests and for tests of its callers (the KV connector), which
want a real gRPC kvstore on a free port without starting a process.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

from kvmesh.kvstore.block import PutOutcome, crc32
from kvmesh.kvstore.memory_tier import MemoryTier
from kvmesh.kvstore.server import KVStoreServicer
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, PortAccess
from kvmesh.services.runtime.grpc_server import GrpcService


class FakeClock:
    """A clock tests advance by hand (``clock.now += 5``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def numbered_key(i: int) -> bytes:
    """A distinct store key per number."""
    return i.to_bytes(8, "little")


def numbered_payload(i: int, size: int = 100) -> bytes:
    """``size`` bytes that differ from number to number (mod 256)."""
    return bytes([i % 256]) * size


def put_block(store: MemoryTier | TieredStore, key: bytes, data: bytes) -> PutOutcome:
    """A whole two-phase put (begin, two chunks, commit with the right CRC-32)."""
    pending = store.begin_put(key, len(data))
    if pending is None:
        return PutOutcome.NO_ROOM
    pending.write(data[: len(data) // 2])
    pending.write(data[len(data) // 2 :])
    return store.commit_put(pending, crc32(data))


@contextlib.asynccontextmanager
async def serve_store(
    store: TieredStore, *, max_lease_ttl_s: float = 60.0, access: PortAccess = NO_INTERNAL_AUTH
) -> AsyncIterator[str]:
    """Serve ``store`` over gRPC on a free loopback port; yields its address."""
    service = GrpcService(
        "kvstore", [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name], access=access
    )
    servicer = KVStoreServicer(store, max_lease_ttl_s=max_lease_ttl_s)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, service.server)
    port = await service.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await service.stop(grace=0)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run a throwaway ``redis-server`` (no persistence) on a free port; yields its URL.

    Raises FileNotFoundError when redis-server is not on PATH (``make install``
    installs it where it can).
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"redis-server not listening on {port} after {timeout_s}s")
