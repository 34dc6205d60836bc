"""``kvmesh up``: start the whole stack as separate processes and supervise them.

Every service runs as ``python -m kvmesh.services.cli.main serve <name>``, configured
through ``KVMESH_*`` variables built from this command's flags (each flag
also reads its own variable). The launcher waits until every service is
ready, restarts a service that dies or hangs (fails its liveness probe,
``services/cli/supervision.py``; its dependents see it unavailable meanwhile, as
in production) at most ``--max-restarts`` times per ``--restart-window-s``,
and on SIGINT/SIGTERM stops them all, the gateway first so that no new work
arrives while the rest drain.

Internal calls are authenticated by default: unless ``--internal-auth-token``
is given (or ``--no-internal-auth``), the launcher makes a random token for
this stack and hands it to every child in its environment (never on a command
line, which ``ps`` shows). ``--internal-tls`` also makes a throwaway CA and
certificate (``services/runtime/stack_credentials.py``) in a private folder removed
at exit, and every internal call then runs over mutual TLS.

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
import contextlib
import dataclasses
import logging
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.services.cli.supervision import LivenessWatch, RestartBudget
from kvmesh.services.contracts.replica_set import ReplicaAddress, write_replica_set
from kvmesh.services.runtime.config import (
    SERVICE_CONFIGS,
    CommonConfig,
    LauncherConfig,
    add_config_arguments,
    as_env_text,
    config_from_namespace,
    config_to_env,
    environment_without_options,
)
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import LIVENESS_SERVICE, probe_channel
from kvmesh.services.runtime.stack_credentials import make_stack_certificates, new_token

logger = logging.getLogger("kvmesh.launcher")

# Start order; shutdown goes in reverse.
START_ORDER = ("kvstore", "worker", "scheduler", "detokenizer", "gateway")
# ``--disaggregated`` adds a prefill replica: a second worker and scheduler
# (``serve worker`` / ``serve scheduler`` with the launcher's prefill ports),
# each started right after its decode twin.
PREFILL_REPLICA = {"prefill_worker": "worker", "prefill_scheduler": "scheduler"}
# ``--tensor-parallel-size T --pipeline-parallel-size P``: the worker is rank 0
# (the driver the scheduler dials) and ranks 1..T*P-1 are its siblings, each
# ``serve worker --rank R``. They live and die together.
WORKER_RANK_PREFIX = "worker_rank"
# The prefill replica's ranks (``--disaggregated`` with T x P > 1), beside its
# driver ``prefill_worker``, meeting at their own rendezvous port.
PREFILL_RANK_PREFIX = "prefill_worker_rank"
RANK_PREFIXES = (WORKER_RANK_PREFIX, PREFILL_RANK_PREFIX)
# Each replica of ``--data-parallel-size`` beyond the first is these three,
# named ``<service>-<i>`` and moved by ``i * --replica-port-offset``.
REPLICA_SERVICES = ("worker", "scheduler", "detokenizer")
REPLICA_PORTS = {name: (f"{name}_port", f"{name}_metrics_port") for name in REPLICA_SERVICES}
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


def stack_configs(args: argparse.Namespace, replica_set_file: str = "") -> dict[str, Any]:
    """Each process's config for one machine: addresses follow ports, one model for all.

    Keyed by service name (replica 0's), plus ``worker-<i>``, ``scheduler-<i>``
    and ``detokenizer-<i>`` for each further replica of ``--data-parallel-size``,
    plus ``prefill_worker`` and ``prefill_scheduler`` with ``--disaggregated``:
    their twins' configs on the prefill ports. The gateway learns the replicas
    from ``replica_set_file`` (the launcher writes it, ``services/contracts/replica_set.py``).
    """
    launcher = config_from_namespace(LauncherConfig, args)
    configs = {name: config_from_namespace(SERVICE_CONFIGS[name], args) for name in START_ORDER}
    local: dict[str, Any] = {
        f"{name}_addr": f"{LOCAL_HOST}:{getattr(configs[name], f'{name}_port')}"
        for name in DIALED_SERVICES
    }
    if replica_set_file:
        local["replica_discovery"] = "file"
        local["replica_set_file"] = replica_set_file
    # The gateway prefills on the prefill replica only under --disaggregated.
    local["prefill_scheduler_addr"] = ""
    if launcher.disaggregated:
        local["prefill_scheduler_addr"] = f"{LOCAL_HOST}:{launcher.prefill_scheduler_port}"
        local["kv_offload"] = True  # KV travels between the replicas through the store
    worker = configs["worker"]
    world_size = worker.tensor_parallel_size * worker.pipeline_parallel_size
    num_workers = (launcher.data_parallel_size + launcher.disaggregated) * world_size
    if num_workers > 1 and worker.num_threads == 0:
        # Several workers on one machine: each owns its share of the cores (two
        # OpenMP teams over the same cores stall each other at every barrier).
        local["num_threads"] = max(1, (os.cpu_count() or 2) // num_workers)
    if not configs["worker"].model:
        # Prepare the default model once here, not racing in three services.
        from kvmesh.services.runtime.model_prep import prepare_default_model

        local["model"] = str(prepare_default_model())
    configs = {
        name: dataclasses.replace(config, **{k: v for k, v in local.items() if hasattr(config, k)})
        for name, config in configs.items()
    }
    for i in range(1, launcher.data_parallel_size):
        configs.update(replica_configs(configs, i, i * launcher.replica_port_offset))
    if launcher.disaggregated:
        configs["prefill_worker"] = dataclasses.replace(
            configs["worker"],
            worker_port=launcher.prefill_worker_port,
            worker_metrics_port=launcher.prefill_worker_metrics_port,
        )
        if world_size > 1:
            # Its ranks meet at the rendezvous port a second data-parallel
            # replica would use: --disaggregated runs no second one.
            host, _, port = configs["worker"].dist_init_addr.rpartition(":")
            configs["prefill_worker"] = dataclasses.replace(
                configs["prefill_worker"],
                dist_init_addr=f"{host}:{int(port) + launcher.replica_port_offset}",
            )
        for rank in range(1, world_size):
            configs[f"{PREFILL_RANK_PREFIX}{rank}"] = dataclasses.replace(
                configs["prefill_worker"], rank=rank
            )
        configs["prefill_scheduler"] = dataclasses.replace(
            configs["scheduler"],
            scheduler_port=launcher.prefill_scheduler_port,
            scheduler_metrics_port=launcher.prefill_scheduler_metrics_port,
            worker_addr=f"{LOCAL_HOST}:{launcher.prefill_worker_port}",
        )
    for suffix in replica_names(configs):
        tail = f"-{suffix}" if suffix else ""
        driver = configs[f"worker{tail}"]
        for rank in range(1, world_size):
            configs[f"{WORKER_RANK_PREFIX}{rank}{tail}"] = dataclasses.replace(driver, rank=rank)
    return configs


def secure_stack(
    configs: dict[str, Any], launcher: LauncherConfig, scratch: contextlib.ExitStack
) -> dict[str, Any]:
    """Every process's config with the stack's internal credentials: those given, or
    made now for this stack (certificates in a private folder ``scratch`` removes)."""
    given = configs["gateway"]  # the options every service shares are set alike on all
    credentials: dict[str, str] = {}
    if launcher.internal_auth and not given.internal_auth_token:
        credentials["internal_auth_token"] = new_token()
    if launcher.internal_tls and not given.internal_tls_certfile:
        folder = scratch.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-tls-"))
        certificates = make_stack_certificates(Path(folder))
        credentials["internal_tls_certfile"] = str(certificates.certfile)
        credentials["internal_tls_keyfile"] = str(certificates.keyfile)
        credentials["internal_tls_ca_certs"] = str(certificates.ca_certs)
    return {name: dataclasses.replace(c, **credentials) for name, c in configs.items()}


def replica_configs(configs: dict[str, Any], i: int, offset: int) -> dict[str, Any]:
    """Replica ``i``'s worker, scheduler and detokenizer: replica 0's, each port
    moved by ``offset``, each dialing its own replica's processes."""
    moved = {
        name: dataclasses.replace(
            configs[name], **{p: getattr(configs[name], p) + offset for p in REPLICA_PORTS[name]}
        )
        for name in REPLICA_SERVICES
    }
    moved["scheduler"] = dataclasses.replace(
        moved["scheduler"], worker_addr=f"{LOCAL_HOST}:{moved['worker'].worker_port}"
    )
    # A parallel replica's ranks meet at their own rendezvous port.
    host, _, port = moved["worker"].dist_init_addr.rpartition(":")
    moved["worker"] = dataclasses.replace(
        moved["worker"], dist_init_addr=f"{host}:{int(port) + offset}"
    )
    moved["detokenizer"] = dataclasses.replace(
        moved["detokenizer"], scheduler_addr=f"{LOCAL_HOST}:{moved['scheduler'].scheduler_port}"
    )
    return {f"{name}-{i}": config for name, config in moved.items()}


def service_of(name: str) -> str:
    """The service a child process runs: ``scheduler-1`` and ``prefill_scheduler`` run
    ``scheduler``, ``worker_rank1`` runs ``worker``."""
    if name.startswith(RANK_PREFIXES):
        return "worker"
    return PREFILL_REPLICA.get(name, name.split("-")[0])


def replica_of(name: str) -> str:
    """Children restarted together: a tensor/pipeline-parallel worker's ranks, as
    one (``worker_rank2-1`` with ``worker-1``); every other child alone."""
    if name.startswith(PREFILL_RANK_PREFIX):
        return "prefill_worker"
    if not name.startswith(WORKER_RANK_PREFIX):
        return name
    _, dash, suffix = name.partition("-")
    return f"worker{dash}{suffix}"


def replica_names(configs: dict[str, Any]) -> list[str]:
    """Replica 0 (``""``: the plain service names) and each further one's suffix."""
    return ["", *sorted({n.split("-")[1] for n in configs if "-" in n}, key=int)]


def replica_addresses(configs: dict[str, Any]) -> list[ReplicaAddress]:
    """What the gateway reaches of each engine replica."""
    replicas = []
    for suffix in replica_names(configs):
        tail = f"-{suffix}" if suffix else ""
        replicas.append(
            ReplicaAddress(
                name=f"replica-{suffix or 0}",
                scheduler_addr=f"{LOCAL_HOST}:{configs['scheduler' + tail].scheduler_port}",
                detokenizer_addr=f"{LOCAL_HOST}:{configs['detokenizer' + tail].detokenizer_port}",
            )
        )
    return replicas


def child_order(configs: dict[str, Any]) -> list[str]:
    """The processes to start, in order: each replica's and prefill process after its twin."""
    order = []
    for name in START_ORDER:
        replicas = [name, *(n for n in configs if n.startswith(f"{name}-"))]
        for replica in replicas:
            if name == "worker":
                # Ranks before their driver, so that shutdown, in reverse, stops
                # the driver first: it tells the ranks to stop, instead of
                # waiting in a broadcast to ranks already gone.
                order.extend(
                    sorted(
                        n
                        for n in configs
                        if n.startswith(WORKER_RANK_PREFIX) and replica_of(n) == replica
                    )
                )
            order.append(replica)
        for prefill, twin in PREFILL_REPLICA.items():
            if twin == name and prefill in configs:
                # The prefill replica's ranks before its driver, as above.
                order.extend(sorted(n for n in configs if n.startswith(f"{prefill}_rank")))
                order.append(prefill)
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
            [sys.executable, "-m", "kvmesh.services.cli.main", "serve", self.service, *self.flags],
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


def _grpc_serving(
    address: str, security: InternalSecurity, service: str = "", timeout: float = 1.0
) -> bool:
    with probe_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# The gateway's own port probed on loopback, where its public certificate (if any)
# need not name 127.0.0.1: the probe reads a status code and sends nothing secret.
_LOOPBACK_TLS = ssl.create_default_context()
_LOOPBACK_TLS.check_hostname = False
_LOOPBACK_TLS.verify_mode = ssl.CERT_NONE


def _http_ready(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=_LOOPBACK_TLS) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Stack:
    def __init__(
        self,
        launcher: LauncherConfig,
        configs: dict[str, Any],
        replica_set_file: Path | None = None,
    ) -> None:
        self.launcher = launcher
        # Where the gateway reads the replicas from (written at start).
        self.replica_set_file = replica_set_file
        self.configs = configs
        self.order = child_order(configs)
        self.security = InternalSecurity.from_config(configs["gateway"])
        gateway = configs["gateway"]
        self.gateway_url = (
            f"{'https' if gateway.ssl_certfile else 'http'}://{LOCAL_HOST}:{gateway.http_port}"
        )
        self.children: dict[str, _Child] = {}
        for name in self.order:
            service = service_of(name)
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
        service = service_of(name)
        return f"{LOCAL_HOST}:{getattr(self.configs[name], f'{service}_port')}"

    def _ready(self, name: str) -> bool:
        if name.startswith(RANK_PREFIXES):
            return True  # serves nothing: the driver is ready only once every rank joined
        if name == "gateway":
            return _http_ready(f"{self.gateway_url}/ready")
        return _grpc_serving(self._address(name), self.security)

    def _live(self, name: str) -> bool:
        """Liveness, not readiness: a service waiting for another is alive."""
        if name.startswith(RANK_PREFIXES):
            return True  # alive while it runs: a rank that fails a collective exits
        if name == "gateway":
            return _http_ready(f"{self.gateway_url}/health", _LIVENESS_TIMEOUT_S)
        return _grpc_serving(
            self._address(name), self.security, LIVENESS_SERVICE, _LIVENESS_TIMEOUT_S
        )

    def start(self) -> None:
        if self.replica_set_file is not None:
            write_replica_set(self.replica_set_file, replica_addresses(self.configs))
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
                self._restart_replica(child)
            time.sleep(0.5)
        return 0

    def _restart_replica(self, died: _Child) -> None:
        """Restart ``died`` and, for a parallel worker rank, every rank of its replica:
        the survivors' process groups, KV caches and batches are useless alone."""
        replica = [c for c in self.children.values() if replica_of(c.name) == replica_of(died.name)]
        for child in replica:
            if child is not died and child.alive():
                logger.error("restarting %s with its replica", child.name)
                child.process.kill()
                child.process.wait()
        for child in replica:
            child.start()

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
    launcher = config_from_namespace(LauncherConfig, args)
    with contextlib.ExitStack() as scratch:
        # The replica set lives as long as this launcher: a private folder, removed at exit.
        run_dir = scratch.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-"))
        replica_set_file = Path(run_dir) / "replicas.json"
        configs = secure_stack(stack_configs(args, str(replica_set_file)), launcher, scratch)
        return _run_stack(Stack(launcher, configs, replica_set_file))


def _internal_auth_words(security: InternalSecurity) -> str:
    on = {"token": bool(security.token), "mutual TLS": security.mutual_tls}
    checks = [name for name, enabled in on.items() if enabled]
    return "need " + " and ".join(checks) if checks else "are open (--no-internal-auth)"


def _run_stack(stack: Stack) -> int:
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
            "kvmesh is ready in %.1fs: OpenAI API %s/v1, gRPC %s:%d; internal calls %s",
            time.monotonic() - started,
            stack.gateway_url,
            LOCAL_HOST,
            gw.grpc_port,
            _internal_auth_words(stack.security),
        )
        print(f"{READY_MARKER} {stack.gateway_url}", flush=True)
        return stack.supervise(stopping)
    finally:
        stack.stop()
