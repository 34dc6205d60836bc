"""Responses kept in the kvstore, so that every gateway replica can continue a conversation.

Each response is one kvstore block under a layout of its own (no KV cache has
it, so no model's blocks can collide with it), keyed by the SHA-256 of its id;
the block holds the entry as JSON with its expiry (wall-clock time, shared by
replicas). The kvstore bounds the bytes and evicts the least recently used
blocks; expiry is checked on read. A kvstore that cannot be reached is a 503
on read (the response may well exist) and a logged miss on write (the
response was still served, only not kept).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable

from kvmesh.gateway.responses.store import ResponseStore, ResponseStoreConfig, StoredResponse
from kvmesh.kvstore.block import PutOutcome
from kvmesh.kvstore.client import KVStoreClient, KVStoreError
from kvmesh.kvstore.layout import KVLayout
from kvmesh.services.contracts.errors import UnavailableError

logger = logging.getLogger(__name__)

# The namespace of stored responses: not a KV layout any model has.
RESPONSES_LAYOUT = KVLayout(model="kvmesh.responses", dtype="json", block_size=1, layout_version=1)


def _key(response_id: str) -> bytes:
    return hashlib.sha256(response_id.encode("utf-8")).digest()


class KVStoreResponseStore(ResponseStore):
    """Entries in a kvstore shared by the gateway replicas; ``ttl_s`` from the config."""

    def __init__(
        self,
        client: KVStoreClient,
        config: ResponseStoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._config = config or ResponseStoreConfig()
        self._clock = clock

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        payload = {
            "id": response_id,
            "expires_at": self._clock() + self._config.ttl_s,
            "response": entry.response,
            "messages": entry.messages,
        }
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        try:
            # A block is written once: replacing one means dropping the old copy first.
            await self._client.delete(RESPONSES_LAYOUT, [_key(response_id)])
            (outcome,) = await self._client.put_blocks(
                RESPONSES_LAYOUT, [(_key(response_id), data)]
            )
        except KVStoreError as exc:
            logger.warning("response %s: not stored, kvstore failed: %s", response_id, exc)
            return
        if outcome not in (PutOutcome.STORED, PutOutcome.ALREADY_STORED):
            logger.warning(
                "response %s: not stored, kvstore answered %s (%d bytes)",
                response_id,
                outcome.name,
                len(data),
            )

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            result = await self._client.get_blocks(RESPONSES_LAYOUT, [_key(response_id)])
        except KVStoreError as exc:
            raise UnavailableError(f"the response store is unreachable: {exc}") from exc
        (data,) = result.blocks
        if data is None:
            return None
        payload = json.loads(data)
        if payload.get("id") != response_id:
            return None  # another id with the same SHA-256: never in practice
        if payload["expires_at"] <= self._clock():
            # Expired either way: a failed delete leaves it to the kvstore's eviction.
            with contextlib.suppress(KVStoreError):
                await self._client.delete(RESPONSES_LAYOUT, [_key(response_id)])
            return None
        return StoredResponse(payload["response"], payload["messages"])

    async def delete(self, response_id: str) -> bool:
        try:
            return await self._client.delete(RESPONSES_LAYOUT, [_key(response_id)]) > 0
        except KVStoreError as exc:
            raise UnavailableError(f"the response store is unreachable: {exc}") from exc

    async def close(self) -> None:
        await self._client.close()
