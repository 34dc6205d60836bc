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
import logging
import os
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
    as_env_text,
    config_from_namespace,
    config_to_env,
    environment_without_options,
)
from services.grpc_server import LIVENESS_SERVICE
from services.supervision import LivenessWatch, RestartBudget

logger = logging.getLogger("kvmesh.launcher")

# Start order; shutdown goes in reverse.
START_ORDER = ("kvstore", "worker", "scheduler", "detokenizer", "gateway")
# ``--disaggregated`` adds a prefill replica: a second worker and scheduler
# (``serve worker`` / ``serve scheduler`` with the launcher's prefill ports),
# each started right after its decode twin.
PREFILL_REPLICA = {"prefill_worker": "worker", "prefill_scheduler": "scheduler"}
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
# their ``<name>_port`` (and the gateway's ``prefill_scheduler_addr`` the
# launcher's ``prefill_scheduler_port``), so ``kvmesh up`` has no address flags.
DIALED_SERVICES = ("worker", "scheduler", "detokenizer", "kvstore")
FOLLOWING_ADDRESSES = {f"{name}_addr" for name in DIALED_SERVICES} | {"prefill_scheduler_addr"}


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options, then each service's (each name once, where it is first used)."""
    seen = set(FOLLOWING_ADDRESSES)
    add_config_arguments(parser.add_argument_group("launcher"), LauncherConfig)
    add_config_arguments(parser.add_argument_group("every service"), CommonConfig)
    seen.update(f.name for f in dataclasses.fields(CommonConfig))
    for name in START_ORDER:
        cls = SERVICE_CONFIGS[name]
        add_config_arguments(parser.add_argument_group(name), cls, exclude=seen)
        seen.update(f.name for f in dataclasses.fields(cls))


def stack_configs(args: argparse.Namespace) -> dict[str, Any]:
    """Each process's config for one machine: addresses follow ports, one model for all.

    Keyed by service name, plus ``prefill_worker`` and ``prefill_scheduler``
    with ``--disaggregated``: their twins' configs on the prefill ports.
    """
    launcher = config_from_namespace(LauncherConfig, args)
    configs = {name: config_from_namespace(SERVICE_CONFIGS[name], args) for name in START_ORDER}
    local: dict[str, Any] = {
        f"{name}_addr": f"{LOCAL_HOST}:{getattr(configs[name], f'{name}_port')}"
        for name in DIALED_SERVICES
    }
    # The gateway prefills on the prefill replica only under --disaggregated.
    local["prefill_scheduler_addr"] = ""
    if launcher.disaggregated:
        local["prefill_scheduler_addr"] = f"{LOCAL_HOST}:{launcher.prefill_scheduler_port}"
        local["kv_offload"] = True  # KV travels between the replicas through the store
        if configs["worker"].num_threads == 0:
            # Two workers on one machine: each owns half the cores (two OpenMP
            # teams over the same cores stall each other at every barrier).
            local["num_threads"] = max(1, (os.cpu_count() or 2) // 2)
    if not configs["worker"].model:
        # Prepare the default model once here, not racing in three services.
        from services.model_prep import prepare_default_model

        local["model"] = str(prepare_default_model())
    configs = {
        name: dataclasses.replace(config, **{k: v for k, v in local.items() if hasattr(config, k)})
        for name, config in configs.items()
    }
    if launcher.disaggregated:
        configs["prefill_worker"] = dataclasses.replace(
            configs["worker"],
            worker_port=launcher.prefill_worker_port,
            worker_metrics_port=launcher.prefill_worker_metrics_port,
        )
        configs["prefill_scheduler"] = dataclasses.replace(
            configs["scheduler"],
            scheduler_port=launcher.prefill_scheduler_port,
            scheduler_metrics_port=launcher.prefill_scheduler_metrics_port,
            worker_addr=f"{LOCAL_HOST}:{launcher.prefill_worker_port}",
        )
    return configs


def child_order(configs: dict[str, Any]) -> list[str]:
    """The processes to start, in order: each prefill process after its decode twin."""
    order = []
    for name in START_ORDER:
        order.append(name)
        order.extend(p for p, twin in PREFILL_REPLICA.items() if twin == name and p in configs)
    return order


def flags_differing(base: Any, config: Any) -> list[str]:
    """The flags that turn ``base`` into ``config`` (same class), e.g. a prefill
    replica's ports: they win over the environment all children share."""
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == getattr(base, f.name):
            continue
        name = f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, tuple):
            flags += [f"--{name}", *value]
        else:
            flags += [f"--{name}", as_env_text(value)]
    return flags


@dataclass
class _Child:
    name: str
    env: dict[str, str]
    # The service it runs (its name, but for the prefill replica) and the flags
    # that set it apart from its twin.
    service: str
    flags: list[str]
    restarts: RestartBudget
    liveness: LivenessWatch
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", self.service, *self.flags],
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
        self.order = child_order(configs)
        self.children: dict[str, _Child] = {}
        for name in self.order:
            service = PREFILL_REPLICA.get(name, name)
            env = environment_without_options()
            for service_name in START_ORDER:  # one shared environment; twins differ by flags
                env.update(config_to_env(self.configs[service_name]))
            if service != "worker":
                env.update(_SINGLE_THREAD_ENV)
            env.setdefault("PYTHONUNBUFFERED", "1")
            flags = flags_differing(configs[service], configs[name])
            self.children[name] = _Child(
                name,
                env,
                service,
                flags,
                RestartBudget(launcher.max_restarts, launcher.restart_window_s),
                LivenessWatch(launcher.liveness_period_s),
            )

    def _address(self, name: str) -> str:
        """host:port of a gRPC service process (the prefill replica's on its own port)."""
        service = PREFILL_REPLICA.get(name, name)
        return f"{LOCAL_HOST}:{getattr(self.configs[name], f'{service}_port')}"

    def _ready(self, name: str) -> bool:
        if name == "gateway":
            return _http_ready(f"http://{LOCAL_HOST}:{self.configs[name].http_port}/ready")
        return _grpc_serving(self._address(name))

    def _live(self, name: str) -> bool:
        """Liveness, not readiness: a service waiting for another is alive."""
        if name == "gateway":
            return _http_ready(
                f"http://{LOCAL_HOST}:{self.configs[name].http_port}/health", _LIVENESS_TIMEOUT_S
            )
        return _grpc_serving(self._address(name), LIVENESS_SERVICE, _LIVENESS_TIMEOUT_S)

    def start(self) -> None:
        for name in self.order:
            self.children[name].start()

    def wait_ready(self, stopping: list[bool]) -> bool:
        deadline = time.monotonic() + self.launcher.startup_timeout
        pending = list(self.order)
        while pending and not stopping:
            for name in list(pending):
                child = self.children[name]
                if not child.alive():
                    logger.error(
                        "%s exited during start-up (code %s)", name, child.process.returncode
                    )
                    return False
                if self._ready(name):
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
        if child.liveness.record(self._live(child.name)):
            logger.error(
                "%s (pid %d) failed %d liveness probes in a row; killing it to restart it",
                child.name,
                child.process.pid,
                child.liveness.failures,
            )
            child.process.kill()
            child.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        for name in reversed(self.order):
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
