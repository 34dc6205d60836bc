"""Where responses are kept for GET /v1/responses/{id} and ``previous_response_id``.

``ResponseStore`` is the contract; ``MemoryResponseStore`` keeps them in this
gateway's memory, bounded in count (the least recently used goes first) and
in age (an entry expires ``ttl_s`` after it was stored), so a busy server's
memory stays flat. A store shared by several gateway replicas (the kvstore, or
Redis) implements the same three calls; the methods are coroutines so that
such a store can do its I/O. ``KVStoreResponseStore`` (kvstore_store.py) is one.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.services.runtime.config import GatewayConfig

_DEFAULTS = GatewayConfig()


@dataclass(frozen=True)
class StoredResponse:
    """One response and the conversation that continues from it."""

    # The response object as GET returns it (ResponseObject, dumped).
    response: dict[str, Any]
    # Every chat message up to and including this response's output, without
    # instructions: what a request with previous_response_id=this id follows.
    messages: list[dict[str, Any]]


class ResponseStore(abc.ABC):
    """Responses by id. An entry may vanish at any time (bounds, expiry, a restart):
    a caller treats a missing id as the client's error (404), never as a bug."""

    @abc.abstractmethod
    async def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep ``entry`` under ``response_id``, replacing any earlier one."""

    @abc.abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when it was never stored, was deleted or has expired."""

    @abc.abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Forget the entry; False when there was none."""

    async def close(self) -> None:  # noqa: B027 (most stores hold nothing to close)
        """Release connections; the store is not used afterwards."""


@dataclass(frozen=True)
class ResponseStoreConfig:
    max_entries: int = _DEFAULTS.responses_max_stored
    ttl_s: float = _DEFAULTS.responses_ttl_s

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {self.max_entries}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ResponseStoreConfig:
        return cls(max_entries=config.responses_max_stored, ttl_s=config.responses_ttl_s)


class MemoryResponseStore(ResponseStore):
    """In this process, least recently used first out, each entry expiring after ``ttl_s``."""

    def __init__(
        self,
        config: ResponseStoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config or ResponseStoreConfig()
        self._clock = clock
        # id -> (expiry time, entry), least recently used first.
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        now = self._clock()
        self._drop_expired(now)
        self._entries.pop(response_id, None)
        self._entries[response_id] = (now + self._config.ttl_s, entry)
        while len(self._entries) > self._config.max_entries:
            self._entries.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is None:
            return None
        expiry, entry = found
        if expiry <= self._clock():
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry

    async def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def _drop_expired(self, now: float) -> None:
        # A read moves an entry to the end, so expired entries may sit behind
        # live ones; they are swept whenever the least recently used one has
        # expired (get() refuses any expired entry, and the count bound holds
        # memory in between).
        if not self._entries or next(iter(self._entries.values()))[0] > now:
            return
        for response_id in [key for key, (expiry, _) in self._entries.items() if expiry <= now]:
            del self._entries[response_id]
