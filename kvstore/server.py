"""kvstore process: gRPC KVStore service over a BlockStore."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from prometheus_client import Counter, Gauge

from kvstore.store import BlockStore
from protos import kvstore_pb2, kvstore_pb2_grpc
from services.config import KVStoreConfig
from services.errors import InvalidRequestError
from services.grpc_server import GrpcService
from services.metrics import start_metrics_server

logger = logging.getLogger(__name__)

_BLOCKS = Gauge("kvmesh:kvstore_blocks", "KV blocks held by the store")
_BYTES = Gauge("kvmesh:kvstore_bytes_used", "bytes of KV blocks held by the store")
_CAPACITY = Gauge("kvmesh:kvstore_capacity_bytes", "configured capacity of the store")
_OPS = Counter("kvmesh:kvstore_block_ops_total", "block operations by kind", ["op"])


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def _export(self) -> None:
        stats = self.store.stats()
        _BLOCKS.set(stats.num_blocks)
        _BYTES.set(stats.bytes_used)

    async def PutBlocks(self, request, context: grpc.aio.ServicerContext):
        stored = [self.store.put(b.key, b.data) for b in request.blocks]
        _OPS.labels("put").inc(len(stored))
        self._export()
        return kvstore_pb2.PutBlocksResponse(stored=stored)

    async def GetBlocks(self, request, context: grpc.aio.ServicerContext):
        blocks = []
        for key in request.keys:
            data = self.store.get(key)
            if data is not None:
                blocks.append(kvstore_pb2.KVBlock(key=key, data=data))
        _OPS.labels("get").inc(len(request.keys))
        return kvstore_pb2.GetBlocksResponse(blocks=blocks)

    async def ContainsBlocks(self, request, context: grpc.aio.ServicerContext):
        return kvstore_pb2.ContainsBlocksResponse(present=self.store.contains(list(request.keys)))

    async def DeleteBlocks(self, request, context: grpc.aio.ServicerContext):
        n = self.store.delete(list(request.keys))
        _OPS.labels("delete").inc(len(request.keys))
        self._export()
        return kvstore_pb2.DeleteBlocksResponse(num_deleted=n or 0)

    async def LeaseBlocks(self, request, context: grpc.aio.ServicerContext):
        keys = list(request.keys)
        present = self.store.contains(keys)
        try:
            lease_id = self.store.lease(
                [k for k, p in zip(keys, present, strict=True) if p], request.ttl_seconds
            )
        except ValueError as exc:  # the store's one refusal: a ttl that is not positive
            raise InvalidRequestError(str(exc), param="ttl_seconds") from exc
        return kvstore_pb2.LeaseBlocksResponse(lease_id=str(lease_id), leased=present)

    async def ReleaseLease(self, request, context: grpc.aio.ServicerContext):
        with contextlib.suppress(ValueError):  # not one of ours: nothing to release
            self.store.release(int(request.lease_id))
        return kvstore_pb2.ReleaseLeaseResponse()

    async def GetStats(self, request, context: grpc.aio.ServicerContext):
        s = self.store.stats()
        return kvstore_pb2.KVStoreStats(
            num_blocks=s.num_blocks,
            bytes_used=s.bytes_used,
            capacity_bytes=s.capacity_bytes,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
        )


async def serve(config: KVStoreConfig, stop: asyncio.Event) -> None:
    start_metrics_server(config.bind_host, config.kvstore_metrics_port)
    _CAPACITY.set(config.kvstore_capacity_bytes)
    service = GrpcService("kvstore", [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name])
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(
        KVStoreServicer(BlockStore(config.kvstore_capacity_bytes)), service.server
    )
    await service.start(config.bind_host, config.kvstore_port)
    await service.set_serving(True)
    await stop.wait()
    await service.stop()
