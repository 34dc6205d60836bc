"""``kvmesh up``: start the whole stack as separate processes and supervise them.

Every service runs as ``python -m services.cli serve <name>``, configured
through ``KVMESH_*`` variables built from this command's flags (each flag
also reads its own variable). The launcher waits until every service is
ready, restarts a service that dies or hangs (fails its liveness probe,
``services/supervision.py``; its dependents see it unavailable meanwhile, as
in production) at most ``--max-restarts`` times per ``--restart-window-s``,
and on SIGINT/SIGTERM stops them all, the gateway first so that no new work
arrives while the rest drain.

Thread placement is deliberate, for small machines (2 cores) first:

- the worker owns the cores: ``--num-threads`` torch intra-op threads (0, the
  default, means one per CPU), one inter-op thread (a step is one chain of
  ops, each parallelized inside), and its step runs on a single executor
  thread while its event loop only moves protobufs;
- every other service (scheduler, detokenizer, gateway, kvstore) runs with
  ``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` and ``TOKENIZERS_PARALLELISM=false``:
  their per-step work is a few milliseconds of Python, and a second thread
  would only compete with the worker's matrix multiplies;
- ``--async-scheduling`` (on by default) has the scheduler update, publish
  and schedule step n+1 while the worker computes step n (see
  ``SchedulerServiceConfig.async_scheduling`` for what it measured).

The cost of sharing: an OpenMP team of 2 on 2 cores stalls at every barrier
while another process holds one core, so anything else busy on the machine
(a test run, a second stack) slows the worker far more than its own CPU share.
Measure on a quiet machine, or pass ``--num-threads 1`` when the worker must
share its cores for long.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import (
    SERVICE_CONFIGS,
    CommonConfig,
    LauncherConfig,
    add_config_arguments,
    config_from_namespace,
    config_to_env,
    environment_without_options,
)
from services.grpc_server import LIVENESS_SERVICE
from services.supervision import LivenessWatch, RestartBudget

logger = logging.getLogger("kvmesh.launcher")

# Start order; shutdown goes in reverse.
START_ORDER = ("kvstore", "worker", "scheduler", "detokenizer", "gateway")
# Set (never read) for every child but the worker; see the module docstring.
_SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The line on stdout that says the stack is up (LocalStack waits for it).
READY_MARKER = "KVMESH_READY"
LOCAL_HOST = "127.0.0.1"
# A liveness probe that takes longer than this counts as a miss.
_LIVENESS_TIMEOUT_S = 5.0


# Services that others dial: on one machine their ``<name>_addr`` follows
# their ``<name>_port``, so ``kvmesh up`` has no address flags.
DIALED_SERVICES = ("worker", "scheduler", "detokenizer", "kvstore")


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options, then each service's (each name once, where it is first used)."""
    seen = {f"{name}_addr" for name in DIALED_SERVICES}
    add_config_arguments(parser.add_argument_group("launcher"), LauncherConfig)
    add_config_arguments(parser.add_argument_group("every service"), CommonConfig)
    seen.update(f.name for f in dataclasses.fields(CommonConfig))
    for name in START_ORDER:
        cls = SERVICE_CONFIGS[name]
        add_config_arguments(parser.add_argument_group(name), cls, exclude=seen)
        seen.update(f.name for f in dataclasses.fields(cls))


def stack_configs(args: argparse.Namespace) -> dict[str, Any]:
    """Each service's config for one machine: addresses follow ports, one model for all."""
    configs = {name: config_from_namespace(SERVICE_CONFIGS[name], args) for name in START_ORDER}
    local = {
        f"{name}_addr": f"{LOCAL_HOST}:{getattr(configs[name], f'{name}_port')}"
        for name in DIALED_SERVICES
    }
    if not configs["worker"].model:
        # Prepare the default model once here, not racing in three services.
        from services.model_prep import prepare_default_model

        local["model"] = str(prepare_default_model())
    return {
        name: dataclasses.replace(config, **{k: v for k, v in local.items() if hasattr(config, k)})
        for name, config in configs.items()
    }


@dataclass
class _Child:
    name: str
    env: dict[str, str]
    restarts: RestartBudget
    liveness: LivenessWatch
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", self.name],
            env=self.env,
            start_new_session=True,  # our signals go to the launcher, which relays them
            preexec_fn=_die_with_parent,
        )
        self.liveness.restarted()
        logger.info("started %s (pid %d)", self.name, self.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _die_with_parent() -> None:
    """Have Linux SIGTERM the child if the launcher dies without cleaning up (kill -9)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass  # not Linux: a hard-killed launcher may leave children behind


def _grpc_serving(address: str, service: str = "", timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ready(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Stack:
    def __init__(self, launcher: LauncherConfig, configs: dict[str, Any]) -> None:
        self.launcher = launcher
        self.configs = configs
        self.children: dict[str, _Child] = {}
        host = LOCAL_HOST
        cfg = self.configs
        self.ready_checks = {
            "kvstore": lambda: _grpc_serving(f"{host}:{cfg['kvstore'].kvstore_port}"),
            "worker": lambda: _grpc_serving(f"{host}:{cfg['worker'].worker_port}"),
            "scheduler": lambda: _grpc_serving(f"{host}:{cfg['scheduler'].scheduler_port}"),
            "detokenizer": lambda: _grpc_serving(f"{host}:{cfg['detokenizer'].detokenizer_port}"),
            "gateway": lambda: _http_ready(f"http://{host}:{cfg['gateway'].http_port}/ready"),
        }
        # Liveness, not readiness: a service waiting for another is alive.
        self.liveness_checks = {
            name: functools.partial(
                _grpc_serving,
                f"{host}:{getattr(cfg[name], f'{name}_port')}",
                LIVENESS_SERVICE,
                _LIVENESS_TIMEOUT_S,
            )
            for name in DIALED_SERVICES
        }
        self.liveness_checks["gateway"] = functools.partial(
            _http_ready, f"http://{host}:{cfg['gateway'].http_port}/health", _LIVENESS_TIMEOUT_S
        )
        for name in START_ORDER:
            env = environment_without_options()
            for service_config in self.configs.values():
                env.update(config_to_env(service_config))
            if name != "worker":
                env.update(_SINGLE_THREAD_ENV)
            env.setdefault("PYTHONUNBUFFERED", "1")
            self.children[name] = _Child(
                name,
                env,
                RestartBudget(launcher.max_restarts, launcher.restart_window_s),
                LivenessWatch(launcher.liveness_period_s),
            )

    def start(self) -> None:
        for name in START_ORDER:
            self.children[name].start()

    def wait_ready(self, stopping: list[bool]) -> bool:
        deadline = time.monotonic() + self.launcher.startup_timeout
        pending = list(START_ORDER)
        while pending and not stopping:
            for name in list(pending):
                child = self.children[name]
                if not child.alive():
                    logger.error(
                        "%s exited during start-up (code %s)", name, child.process.returncode
                    )
                    return False
                if self.ready_checks[name]():
                    logger.info("%s is ready", name)
                    pending.remove(name)
            if time.monotonic() > deadline:
                logger.error("not ready after %.0fs: %s", self.launcher.startup_timeout, pending)
                return False
            time.sleep(0.25)
        return not pending

    def supervise(self, stopping: list[bool]) -> int:
        while not stopping:
            for child in self.children.values():
                if child.alive():
                    self._kill_if_hung(child)
                    continue
                code = child.process.returncode if child.process else None
                if not child.restarts.try_restart():
                    logger.error(
                        "%s died (code %s) %d times within %.0fs; stopping",
                        child.name,
                        code,
                        child.restarts.recent,
                        child.restarts.window_s,
                    )
                    return 1
                logger.error(
                    "%s died (code %s); restarting (%d within %.0fs)",
                    child.name,
                    code,
                    child.restarts.recent,
                    child.restarts.window_s,
                )
                child.start()
            time.sleep(0.5)
        return 0

    def _kill_if_hung(self, child: _Child) -> None:
        """Probe ``child``'s liveness when due; SIGKILL it once it is judged hung."""
        if not child.liveness.due():
            return
        if child.liveness.record(self.liveness_checks[child.name]()):
            logger.error(
                "%s (pid %d) failed %d liveness probes in a row; killing it to restart it",
                child.name,
                child.process.pid,
                child.liveness.failures,
            )
            child.process.kill()
            child.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        for name in reversed(START_ORDER):
            child = self.children[name]
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0fs; killing it", name, timeout)
                    child.process.kill()
                    child.process.wait()
            logger.info("%s stopped", name)


def run_up(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [launcher] %(message)s"
    )
    stack = Stack(config_from_namespace(LauncherConfig, args), stack_configs(args))
    stopping: list[bool] = []

    def on_signal(signum: int, frame: object) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stopping.append(True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    stack.start()
    try:
        if not stack.wait_ready(stopping):
            return 0 if stopping else 1
        gw = stack.configs["gateway"]
        logger.info(
            "kvmesh is ready in %.1fs: OpenAI API http://%s:%d/v1, gRPC %s:%d",
            time.monotonic() - started,
            LOCAL_HOST,
            gw.http_port,
            LOCAL_HOST,
            gw.grpc_port,
        )
        print(f"{READY_MARKER} http://{LOCAL_HOST}:{gw.http_port}", flush=True)
        return stack.supervise(stopping)
    finally:
        stack.stop()
