"""Which engine replicas exist: one small interface, one implementation per deployment.

Discovery says what exists; readiness (probed by the gateway per replica)
says what may be routed to. So a discovery only has to be eventually right:
a replica that died but is still listed is probed unready and left out of the
picks, and one listed late only joins late.

- ``static``: the one replica of ``--scheduler-addr`` / ``--detokenizer-addr``
  (a gateway in front of a single engine, as before replicas existed).
- ``file``: the set ``kvmesh up`` publishes (``services/contracts/replica_set.py``);
  the launcher rewrites it, the gateway polls it.
- ``dns``: every A/AAAA record of ``--scheduler-addr``'s host, e.g. a
  Kubernetes headless Service (``scheduler-headless``), whose records are the
  ready pods: pods register by becoming ready and deregister by going away,
  and the gateway needs no Kubernetes client or API permissions. Each record
  is one replica pod running scheduler, worker and detokenizer, the
  detokenizer on ``--detokenizer-addr``'s port.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from kvmesh.services.contracts.replica_set import ReplicaAddress, read_replica_set
from kvmesh.services.runtime.config import GatewayConfig, ReplicaDiscoveryName

logger = logging.getLogger(__name__)

ReplicaSet = frozenset[ReplicaAddress]


class ReplicaDiscovery(Protocol):
    def watch(self) -> AsyncIterator[ReplicaSet]:
        """The replica set now, then again each time it changes; runs until cancelled."""
        ...


class StaticDiscovery:
    """A fixed set, announced once."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def watch(self) -> AsyncIterator[ReplicaSet]:
        yield self.replicas
        await asyncio.Event().wait()  # it never changes


class PollingDiscovery(ABC):
    """Looks every ``period_s`` and announces the set when it differs from the last."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s

    @abstractmethod
    async def look(self) -> ReplicaSet | None:
        """The set now, or None when it cannot be known now (the last one stands)."""

    async def watch(self) -> AsyncIterator[ReplicaSet]:
        last: ReplicaSet | None = None
        while True:
            current = await self.look()
            if current is not None and current != last:
                last = current
                yield current
            await asyncio.sleep(self.period_s)


class FileDiscovery(PollingDiscovery):
    """The replica set file the launcher rewrites."""

    def __init__(self, path: Path, period_s: float) -> None:
        super().__init__(period_s)
        self.path = path

    async def look(self) -> ReplicaSet | None:
        try:
            return read_replica_set(self.path)
        except (OSError, ValueError) as error:
            logger.warning("replica set unreadable (%s); keeping the last one", error)
            return None


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DnsDiscovery(PollingDiscovery):
    """One replica per address ``host`` resolves to, named by that address."""

    def __init__(
        self, host: str, scheduler_port: int, detokenizer_port: int, period_s: float
    ) -> None:
        super().__init__(period_s)
        self.host = host
        self.scheduler_port = scheduler_port
        self.detokenizer_port = detokenizer_port

    async def look(self) -> ReplicaSet | None:
        try:
            records = await asyncio.get_running_loop().getaddrinfo(
                self.host, self.scheduler_port, type=socket.SOCK_STREAM
            )
        except socket.gaierror as error:
            # NXDOMAIN (no ready pod) and a DNS outage look alike: keep the
            # last set, whose replicas readiness takes out if they are gone.
            logger.warning("cannot resolve %s (%s); keeping the last set", self.host, error)
            return None
        ips = {str(sockaddr[0]) for *_, sockaddr in records}
        return frozenset(
            ReplicaAddress(
                name=ip,
                scheduler_addr=join_host_port(ip, self.scheduler_port),
                detokenizer_addr=join_host_port(ip, self.detokenizer_port),
            )
            for ip in ips
        )


def make_discovery(config: GatewayConfig) -> ReplicaDiscovery:
    kind = ReplicaDiscoveryName(config.replica_discovery)
    if kind is ReplicaDiscoveryName.FILE:
        if not config.replica_set_file:
            raise ValueError("--replica-discovery file needs --replica-set-file")
        return FileDiscovery(Path(config.replica_set_file), config.replica_poll_period_s)
    if kind is ReplicaDiscoveryName.DNS:
        host, scheduler_port = split_host_port(config.scheduler_addr)
        _, detokenizer_port = split_host_port(config.detokenizer_addr)
        return DnsDiscovery(host, scheduler_port, detokenizer_port, config.replica_poll_period_s)
    single = ReplicaAddress("replica-0", config.scheduler_addr, config.detokenizer_addr)
    return StaticDiscovery(frozenset({single}))
