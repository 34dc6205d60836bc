"""The kvstore as the worker connector's block store, bound to one KV layout."""

from __future__ import annotations

from kvmesh.kvstore.block import PutOutcome
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout

# A put that finds the block there already is as good as a stored one.
_SAVED = (PutOutcome.STORED, PutOutcome.ALREADY_STORED)


class KVStoreBlocks:
    """``kvmesh.worker.kv_connector.KVBlockStore`` over ``KVStoreClient``: keys are this
    worker's layout plus the block hash. Raises ``KVStoreError`` on any failure,
    which the connector counts as a miss (loads) or a failed save."""

    def __init__(self, client: KVStoreClient, layout: KVLayout) -> None:
        self.client = client
        self.layout = layout

    async def get_blocks(self, hashes: list[bytes]) -> list[bytes | None]:
        # No lease: the blocks are copied into the cache as they arrive, and a
        # block evicted meanwhile is simply a miss.
        result = await self.client.get_blocks(self.layout, hashes)
        return result.blocks

    async def put_blocks(self, hashes: list[bytes], datas: list[bytes]) -> list[bool]:
        outcomes = await self.client.put_blocks(self.layout, list(zip(hashes, datas, strict=True)))
        return [outcome in _SAVED for outcome in outcomes]

    async def close(self) -> None:
        await self.client.close()
