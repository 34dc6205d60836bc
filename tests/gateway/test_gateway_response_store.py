"""The in-memory response store: bounded in count (least recently used out) and in age."""

from __future__ import annotations

import pytest

from kvmesh.gateway.responses.store import MemoryResponseStore, ResponseStoreConfig, StoredResponse
from kvmesh.services.runtime.config import GatewayConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(name: str) -> StoredResponse:
    return StoredResponse({"id": name}, [{"role": "user", "content": name}])


async def test_least_recently_used_goes_first_past_the_bound() -> None:
    store = MemoryResponseStore(ResponseStoreConfig(max_entries=2, ttl_s=60))
    await store.put("a", entry("a"))
    await store.put("b", entry("b"))
    assert await store.get("a") == entry("a")  # a is now the most recently used
    await store.put("c", entry("c"))
    assert len(store) == 2
    assert await store.get("b") is None
    assert await store.get("a") == entry("a")
    assert await store.get("c") == entry("c")


async def test_entries_expire_after_the_ttl_even_when_read() -> None:
    clock = Clock()
    store = MemoryResponseStore(ResponseStoreConfig(max_entries=10, ttl_s=60), clock)
    await store.put("a", entry("a"))
    clock.now += 30
    await store.put("b", entry("b"))
    assert await store.get("a") is not None  # reading does not extend the life
    clock.now += 31
    assert await store.get("a") is None
    assert await store.get("b") is not None
    clock.now += 30
    await store.put("c", entry("c"))  # sweeps b, expired behind nothing
    assert len(store) == 1


async def test_delete_and_replace() -> None:
    store = MemoryResponseStore()
    assert not await store.delete("a")
    await store.put("a", entry("a"))
    await store.put("a", entry("b"))
    assert len(store) == 1
    assert await store.get("a") == entry("b")
    assert await store.delete("a")
    assert await store.get("a") is None


def test_config_comes_from_the_gateway_flags_and_is_checked() -> None:
    config = GatewayConfig(responses_max_stored=7, responses_ttl_s=9.0)
    assert ResponseStoreConfig.from_config(config) == ResponseStoreConfig(7, 9.0)
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStoreConfig(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        ResponseStoreConfig(ttl_s=0)
