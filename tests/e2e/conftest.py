"""Start the whole stack once per test session, as `kvmesh up` does, on free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.model_prep import default_model_path, is_prepared

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


def free_ports(n: int) -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Stack:
    process: subprocess.Popen[str]
    http_url: str
    grpc_addr: str
    ports: dict[str, int]
    log: list[str]

    def metrics_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service + '_metrics_port']}/metrics"


PORT_NAMES = (
    "http_port",
    "grpc_port",
    "scheduler_port",
    "scheduler_metrics_port",
    "worker_port",
    "worker_metrics_port",
    "detokenizer_port",
    "detokenizer_metrics_port",
    "kvstore_port",
    "kvstore_metrics_port",
)


def start_stack(extra_args: list[str]) -> Stack:
    if not is_prepared(default_model_path()):
        pytest.skip("default model not prepared (run `make install`)")
    ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
    args = [sys.executable, "-m", "services.cli", "up"]
    for name, port in ports.items():
        args += ["--" + name.replace("_", "-"), str(port)]
    args += extra_args
    # The stack reads only its flags, except where the model cache lives.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVMESH_") or k == "KVMESH_MODEL_CACHE"
    }
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            if line.startswith("KVMESH_READY"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.wait(0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("stack did not start:\n" + "".join(log[-80:]))
    return Stack(
        process=process,
        http_url=f"http://127.0.0.1:{ports['http_port']}",
        grpc_addr=f"127.0.0.1:{ports['grpc_port']}",
        ports=ports,
        log=log,
    )


def stop_stack(stack: Stack) -> int:
    stack.process.send_signal(signal.SIGTERM)
    try:
        return stack.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(stack.process.pid, signal.SIGKILL)
        raise


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    # A small KV pool keeps memory low; 4 096 tokens still fit 16 concurrent
    # requests of ~200 tokens.
    s = start_stack(["--num-kv-blocks", "512", "--max-model-len", "2048"])
    yield s
    code = stop_stack(s)
    assert code == 0, "stack did not stop cleanly:\n" + "".join(s.log[-50:])
