"""Where /metrics listens is configured: its own interface, or nowhere."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvmesh.services.cli.local_stack import free_ports
from kvmesh.services.runtime.config import KVStoreConfig
from kvmesh.services.runtime.metrics import start_metrics_server


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("kvmesh_probe", "a sample to find", registry=registry).inc()
    return registry


def test_metrics_listen_on_the_metrics_bind_host_not_the_service_one() -> None:
    (port,) = free_ports(1)
    config = KVStoreConfig(bind_host="127.0.0.1", metrics_bind_host="127.0.0.2")
    start_metrics_server(config, port, _registry())
    assert "kvmesh_probe_total 1.0" in _scrape("127.0.0.2", port)
    with pytest.raises(urllib.error.URLError):
        _scrape("127.0.0.1", port)


def test_no_expose_metrics_serves_none() -> None:
    (port,) = free_ports(1)
    start_metrics_server(KVStoreConfig(expose_metrics=False), port, _registry())
    with pytest.raises(urllib.error.URLError):
        _scrape("127.0.0.1", port)
