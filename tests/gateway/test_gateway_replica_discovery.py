"""Replica discovery: the launcher's file and DNS records become replica sets, on change."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvmesh.gateway.routing.discovery import (
    DnsDiscovery,
    FileDiscovery,
    StaticDiscovery,
    join_host_port,
    make_discovery,
    split_host_port,
)
from kvmesh.services.contracts.replica_set import (
    ReplicaAddress,
    read_replica_set,
    write_replica_set,
)
from kvmesh.services.runtime.config import REPLICA_DISCOVERIES, GatewayConfig

A = ReplicaAddress("replica-0", "127.0.0.1:6002", "127.0.0.1:6003")
B = ReplicaAddress("replica-1", "127.0.0.1:6102", "127.0.0.1:6103")


def test_the_replica_set_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_replica_set(path, [B, A])
    assert read_replica_set(path) == {A, B}
    assert [p.name for p in tmp_path.iterdir()] == ["replicas.json"]  # no partial file left


async def test_file_discovery_announces_each_change_once(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_replica_set(path, [A])
    seen: list[frozenset[ReplicaAddress]] = []

    async def follow() -> None:
        async for replicas in FileDiscovery(path, period_s=0.01).watch():
            seen.append(replicas)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    write_replica_set(path, [A, B])
    await asyncio.sleep(0.05)
    path.write_text("{not json")  # unreadable: the last set stands
    await asyncio.sleep(0.05)
    write_replica_set(path, [B])
    await asyncio.sleep(0.05)
    task.cancel()
    assert seen == [{A}, {A, B}, {B}]


async def test_dns_discovery_makes_one_replica_per_address() -> None:
    replicas = await DnsDiscovery("localhost", 50052, 50054, period_s=1).look()
    assert replicas is not None
    by_name = {r.name: r for r in replicas}
    assert by_name["127.0.0.1"] == ReplicaAddress("127.0.0.1", "127.0.0.1:50052", "127.0.0.1:50054")
    for replica in replicas:  # an IPv6 record too, if localhost has one
        assert replica.scheduler_addr == join_host_port(replica.name, 50052)


async def test_dns_discovery_keeps_the_last_set_when_the_name_does_not_resolve() -> None:
    assert await DnsDiscovery("no-such-host.invalid", 1, 2, period_s=1).look() is None


def test_host_port_handles_ipv6() -> None:
    assert split_host_port("[fd00::1]:50052") == ("fd00::1", 50052)
    assert join_host_port("fd00::1", 50052) == "[fd00::1]:50052"
    assert split_host_port("scheduler-headless:50052") == ("scheduler-headless", 50052)
    with pytest.raises(ValueError):
        split_host_port("scheduler-headless")


def test_every_declared_discovery_is_built(tmp_path: Path) -> None:
    kinds = {
        "static": StaticDiscovery,
        "file": FileDiscovery,
        "dns": DnsDiscovery,
    }
    assert set(kinds) == set(REPLICA_DISCOVERIES)
    for name, cls in kinds.items():
        config = GatewayConfig(replica_discovery=name, replica_set_file=str(tmp_path / "r.json"))
        assert isinstance(make_discovery(config), cls)
    with pytest.raises(ValueError, match="replica-set-file"):
        make_discovery(GatewayConfig(replica_discovery="file"))


async def test_static_discovery_is_the_configured_replica() -> None:
    config = GatewayConfig(scheduler_addr="h:1", detokenizer_addr="h:2")
    async for replicas in make_discovery(config).watch():
        assert replicas == {ReplicaAddress("replica-0", "h:1", "h:2")}
        break
