"""A ``KVBlockStore`` over the kvstore's gRPC API (protos/kvstore.proto).

The store's keys are flat bytes, so a block's key is ``layout_key + block_hash``:
workers with different layouts never read each other's bytes. Calls are split
so that no message approaches the channel's size limit.
"""

from __future__ import annotations

import logging

import grpc

from protos import kvstore_pb2, kvstore_pb2_grpc
from services.grpc_server import insecure_channel

logger = logging.getLogger(__name__)


class GrpcKVBlockStore:
    """KV blocks in a remote kvstore. Use from one event loop (the channel's)."""

    def __init__(
        self, address: str, max_put_bytes: int = 64 * 1024 * 1024, max_get_keys: int = 64
    ) -> None:
        self.address = address
        # Per PutBlocks call (a single larger block still goes alone).
        self.max_put_bytes = max_put_bytes
        # Per GetBlocks call: 64 blocks of SmolLM2 float32 are ~47 MB.
        self.max_get_keys = max_get_keys
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None

    def _kvstore(self) -> kvstore_pb2_grpc.KVStoreStub:
        # Created on first use, from inside the loop that will run the calls.
        if self._stub is None:
            self._channel = insecure_channel(self.address)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
            logger.info("KV connector uses the kvstore at %s", self.address)
        return self._stub

    async def get_blocks(self, layout_key: bytes, hashes: list[bytes]) -> list[bytes | None]:
        keys = [layout_key + block_hash for block_hash in hashes]
        found: dict[bytes, bytes] = {}
        for start in range(0, len(keys), self.max_get_keys):
            request = kvstore_pb2.GetBlocksRequest(keys=keys[start : start + self.max_get_keys])
            try:
                reply = await self._kvstore().GetBlocks(request)
            except grpc.aio.AioRpcError as exc:
                raise self._unreachable(exc) from exc
            found.update((block.key, block.data) for block in reply.blocks)
        return [found.get(key) for key in keys]

    async def put_blocks(
        self, layout_key: bytes, hashes: list[bytes], datas: list[bytes]
    ) -> list[bool]:
        stored: list[bool] = []
        batch: list[kvstore_pb2.KVBlock] = []
        batch_bytes = 0
        for block_hash, data in zip(hashes, datas, strict=True):
            if batch and batch_bytes + len(data) > self.max_put_bytes:
                stored.extend(await self._put(batch))
                batch, batch_bytes = [], 0
            batch.append(kvstore_pb2.KVBlock(key=layout_key + block_hash, data=data))
            batch_bytes += len(data)
        if batch:
            stored.extend(await self._put(batch))
        return stored

    async def _put(self, blocks: list[kvstore_pb2.KVBlock]) -> list[bool]:
        try:
            reply = await self._kvstore().PutBlocks(kvstore_pb2.PutBlocksRequest(blocks=blocks))
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from exc
        return list(reply.stored)

    def _unreachable(self, exc: grpc.aio.AioRpcError) -> ConnectionError:
        # One line for the connector's log instead of the multi-line RPC error.
        return ConnectionError(f"kvstore at {self.address}: {exc.code().name} {exc.details()}")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None
