"""Run ``kvmesh up`` as a child process on free loopback ports (tests and benchmarks).

The child is started in its own session so that stopping it (SIGTERM, then
SIGKILL of the whole group after a timeout) reaches every service process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvmesh.services.cli.launcher import READY_MARKER
from kvmesh.services.runtime.config import (
    CommonConfig,
    LauncherConfig,
    config_from_namespace,
    environment_without_options,
)
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.ports import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]

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
    # The prefill replica's, used with --disaggregated.
    "prefill_worker_port",
    "prefill_worker_metrics_port",
    "prefill_scheduler_port",
    "prefill_scheduler_metrics_port",
)


class LocalStack:
    """``kvmesh up`` with every port chosen free; ``log`` collects its output."""

    def __init__(
        self,
        extra_args: list[str],
        model: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``extra_env``: process settings for every child on top of this
        process's (e.g. the library ISA caps of an emulated CPU)."""
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        args = [sys.executable, "-m", "kvmesh.services.cli.main", "up"]
        if model is not None:
            args += ["--model", str(model)]
        for name, port in self.ports.items():
            args += ["--" + name.replace("_", "-"), str(port)]
        # The rendezvous of a tensor/pipeline-parallel worker's ranks (unused otherwise).
        args += ["--dist-init-addr", f"127.0.0.1:{free_ports(1)[0]}"]
        # The stack reads only its flags, plus the process settings (where the
        # caches live, the kernels' A/B switches for benchmarks).
        env = {**environment_without_options(), **(extra_env or {})}
        env["PYTHONUNBUFFERED"] = "1"
        self.log: list[str] = []
        self.process = subprocess.Popen(
            [*args, *extra_args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            if line.startswith(READY_MARKER):
                self._ready.set()

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http_port']}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"

    def service_pids(self, service: str) -> list[int]:
        """Process ids serving ``service`` now (launcher children; none while it restarts).

        ``prefill_worker`` and ``prefill_scheduler`` name the prefill replica of
        ``--disaggregated``, launched as its twin with its port as a flag. A
        tensor/pipeline-parallel worker is its driver here, not its other ranks
        (``serve worker --rank R``).
        """
        twin = service.removeprefix("prefill_")
        prefill_flag = f"--{twin}-port {self.ports.get(f'prefill_{twin}_port')} "
        return [
            pid
            for pid, cmdline in _children_of(self.process.pid).items()
            if f"serve {twin}" in cmdline
            and (prefill_flag in cmdline) == (service != twin)
            and "--rank " not in cmdline
        ]

    def service_pid(self, service: str) -> int:
        """Process id of one running service (a child of the launcher), e.g. to kill it."""
        pids = self.service_pids(service)
        if len(pids) != 1:
            raise LookupError(f"{len(pids)} processes serve {service!r}")
        return pids[0]

    def internal_security(self, service: str = "worker") -> InternalSecurity:
        """The credentials the launcher gave ``service`` (a per-stack token by default),
        read from its environment, as any process of the same user could: what a test
        needs to call an internal port as the stack's own services do."""
        environ = _environ_of(self.service_pid(service))
        return InternalSecurity.from_config(
            config_from_namespace(CommonConfig, argparse.Namespace(), environ)
        )

    def metrics_url(self, service: str, replica: int = 0) -> str:
        """Prometheus URL of ``service`` (of engine ``replica`` with --data-parallel-size)."""
        return f"http://127.0.0.1:{self.replica_port(service + '_metrics_port', replica)}/metrics"

    def replica_port(self, port_name: str, replica: int) -> int:
        """Engine ``replica``'s port ``port_name``: replica 0's, moved as ``kvmesh up`` moves it."""
        return self.ports[port_name] + replica * LauncherConfig.replica_port_offset

    def replica_pid(self, service: str, replica: int) -> int:
        """Process id of engine ``replica``'s worker, scheduler or detokenizer."""
        port_flag = f"--{service}-port "
        moved = f"{port_flag}{self.replica_port(f'{service}_port', replica)} "
        pids = [
            pid
            for pid, cmdline in _children_of(self.process.pid).items()
            if f"serve {service} " in f"{cmdline} "
            and (moved in cmdline if replica else port_flag not in cmdline)
        ]
        if len(pids) != 1:
            raise LookupError(f"{len(pids)} processes serve {service!r} of replica {replica}")
        return pids[0]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("stack did not start:\n" + "".join(self.log[-80:]))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a clean stop); SIGKILL the whole group if it hangs. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                raise
        return self.process.returncode


def _environ_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (Linux /proc; same user only)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (entry.decode().partition("=") for entry in entries if b"=" in entry)
    return {name: value for name, _, value in pairs}


def _children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of ``pid`` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # The command name in stat may hold spaces and parentheses: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found[int(entry.name)] = cmdline
    return found
