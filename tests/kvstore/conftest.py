"""Fixtures for kvstore tests: a fake clock and a real redis-server when one is installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvmesh.kvstore.testing import FakeClock, redis_server


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def _redis_server_url() -> Iterator[str]:
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e .)")
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(redis_server())
        except FileNotFoundError:
            pytest.skip("redis-server is not on PATH (make install installs it with apt-get)")
        yield url


@pytest.fixture
def redis_url(_redis_server_url: str) -> Iterator[str]:
    """URL of a real, empty Redis (one redis-server per session, flushed per test)."""
    import redis

    client = redis.Redis.from_url(_redis_server_url)
    with contextlib.closing(client):
        client.flushdb()
    yield _redis_server_url
