"""Prometheus exposition for services without an HTTP server of their own."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Serve ``/metrics`` on a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=registry)
    logger.info("metrics on http://%s:%d/metrics", host, port)
