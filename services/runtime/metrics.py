"""Prometheus exposition for services without an HTTP server of their own.

Where ``/metrics`` listens is configured, not implied: ``--metrics-bind-host``
(default: the service's ``--bind-host``) keeps it on an interface of its own,
and ``--no-expose-metrics`` serves none. Each service's metrics port is its
own, apart from its gRPC port, so a NetworkPolicy can open it to the
monitoring namespace alone (``deploy/k8s/base/networkpolicy.yaml``).
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from kvmesh.services.runtime.config import CommonConfig

logger = logging.getLogger(__name__)


def start_metrics_server(
    config: CommonConfig, port: int, registry: CollectorRegistry = REGISTRY
) -> None:
    """Serve ``/metrics`` on a daemon thread (prometheus_client's own server), if configured."""
    if not config.expose_metrics:
        logger.info("no metrics endpoint (--no-expose-metrics)")
        return
    host = config.metrics_bind_host or config.bind_host
    start_http_server(port, addr=host, registry=registry)
    logger.info("metrics on http://%s:%d/metrics", host, port)
