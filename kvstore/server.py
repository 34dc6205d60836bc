"""kvstore process: the gRPC KVStore service over a TieredStore."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import grpc
from prometheus_client import REGISTRY

from kvmesh.kvstore import metrics
from kvmesh.kvstore.block import CHUNK_BYTES, StoredBlock
from kvmesh.kvstore.disk_spill import DiskSpillTier
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.put_stream import PutStream
from kvmesh.kvstore.tiered import LowerTier, StoreStats, TieredStore
from kvmesh.protos import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.runtime.config import KVStoreConfig
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import GrpcService
from kvmesh.services.runtime.metrics import start_metrics_server

logger = logging.getLogger(__name__)

METRICS_REFRESH_S = 1.0


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: TieredStore, *, max_lease_ttl_s: float) -> None:
        self.store = store
        self._max_lease_ttl_s = max_lease_ttl_s

    async def LookupPrefix(self, request, context: grpc.aio.ServicerContext):
        if not request.layouts:
            raise InvalidRequestError("LookupPrefix needs at least one layout")
        key_lists = [
            _keys(KVLayout.from_proto(layout), request.block_hashes) for layout in request.layouts
        ]
        num = await self.store.lookup_prefix(key_lists)
        return kvstore_pb2.LookupPrefixResponse(num_prefix_blocks=num)

    async def PutBlocks(self, request_iterator, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        stream = PutStream(self.store)
        try:
            async for chunk in request_iterator:
                stream.feed(chunk)
        finally:
            stream.close()  # cancelled, disconnected or failed mid-block: abort it
            metrics.BYTES_IN.inc(stream.bytes_received)
        metrics.PUT_SECONDS.observe(time.perf_counter() - start)
        return kvstore_pb2.PutBlocksResponse(outcomes=[int(o) for o in stream.outcomes])

    async def GetBlocks(self, request, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        ttl = request.lease_ttl_seconds
        if ttl != 0:
            self._check_ttl(ttl)
        layout = KVLayout.from_proto(request.layout)
        blocks, lease_id, leased = await self.store.get(_keys(layout, request.block_hashes), ttl)
        yield kvstore_pb2.GetBlocksChunk(
            header=kvstore_pb2.GetBlocksHeader(
                found=[block is not None for block in blocks], lease_id=lease_id, leased=leased
            )
        )
        for block_hash, block in zip(request.block_hashes, blocks, strict=True):
            if block is not None:
                for message in _block_messages(block_hash, block):
                    yield message
                metrics.BYTES_OUT.inc(block.size)
        metrics.GET_SECONDS.observe(time.perf_counter() - start)

    async def LeaseBlocks(self, request, context: grpc.aio.ServicerContext):
        self._check_ttl(request.ttl_seconds)
        keys = _keys(KVLayout.from_proto(request.layout), request.block_hashes)
        lease_id, leased = await self.store.lease(keys, request.ttl_seconds)
        return kvstore_pb2.LeaseBlocksResponse(lease_id=lease_id, leased=leased)

    async def ReleaseLease(self, request, context: grpc.aio.ServicerContext):
        return kvstore_pb2.ReleaseLeaseResponse(released=self.store.release(request.lease_id))

    async def DeleteBlocks(self, request, context: grpc.aio.ServicerContext):
        keys = _keys(KVLayout.from_proto(request.layout), request.block_hashes)
        return kvstore_pb2.DeleteBlocksResponse(num_deleted=await self.store.delete(keys))

    async def GetStats(self, request, context: grpc.aio.ServicerContext):
        return stats_to_proto(self.store.stats())

    def _check_ttl(self, ttl_s: float) -> None:
        if not 0 < ttl_s <= self._max_lease_ttl_s:
            raise InvalidRequestError(
                f"lease ttl must be in (0, {self._max_lease_ttl_s}] seconds, got {ttl_s}",
                param="ttl_seconds",
            )


def _keys(layout: KVLayout, block_hashes: Sequence[bytes]) -> list[bytes]:
    return [layout.block_key(block_hash) for block_hash in block_hashes]


def _block_messages(block_hash: bytes, block: StoredBlock) -> Iterator[kvstore_pb2.GetBlocksChunk]:
    """A block as GetBlocks messages: begin with the first chunk, then data chunks."""
    data = block.data
    begin = kvstore_pb2.BlockBegin(block_hash=block_hash, size=block.size, crc32=block.crc32)
    if len(data) <= CHUNK_BYTES:  # the common case: one message, no copy
        yield kvstore_pb2.GetBlocksChunk(begin=begin, data=data)
        return
    yield kvstore_pb2.GetBlocksChunk(begin=begin, data=data[:CHUNK_BYTES])
    for offset in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield kvstore_pb2.GetBlocksChunk(data=data[offset : offset + CHUNK_BYTES])


def stats_to_proto(stats: StoreStats) -> kvstore_pb2.KVStoreStats:
    return kvstore_pb2.KVStoreStats(
        tiers=[
            kvstore_pb2.TierStats(
                tier=t.tier,
                num_blocks=t.num_blocks,
                bytes_used=t.bytes_used,
                capacity_bytes=t.capacity_bytes,
                hits=t.hits,
                evictions=t.evictions,
                corrupt_blocks=t.corrupt_blocks,
            )
            for t in stats.tiers
        ],
        misses=stats.misses,
        num_leases=stats.num_leases,
        inflight_puts=stats.inflight_puts,
        failed_puts=sum(stats.failed_puts.values()),
    )


def build_store(config: KVStoreConfig) -> TieredStore:
    """Memory, then disk (memory's evictions), then the shared filesystem, then Redis (both
    shared), each if configured: cheapest first. ValueError if a tier cannot start."""
    lower: list[LowerTier] = []
    if config.kvstore_disk_path:
        lower.append(DiskSpillTier(DiskTier(config.kvstore_disk_path, config.kvstore_disk_bytes)))
    if config.kvstore_shared_fs_path:
        # Imported here, as redis is below: numpy (the sweep's sort) only when configured.
        from kvmesh.kvstore.shared_fs_files import SharedFsUnusable
        from kvmesh.kvstore.shared_fs_tier import SharedFsTier

        try:
            shared_fs = SharedFsTier.from_path(
                config.kvstore_shared_fs_path, config.kvstore_shared_fs_bytes
            )
        except SharedFsUnusable as e:
            raise ValueError(f"--kvstore-shared-fs-path: {e}") from e
        lower.append(shared_fs)
    if config.kvstore_redis_url:
        # Imported here: redis-py is needed only when a Redis tier is configured.
        from kvmesh.kvstore.redis_tier import RedisTier

        lower.append(RedisTier.from_url(config.kvstore_redis_url))
    return TieredStore(
        config.kvstore_capacity_bytes,
        lower,
        high_watermark=config.kvstore_high_watermark,
        low_watermark=config.kvstore_low_watermark,
    )


async def _refresh_metrics(store: TieredStore, collector: metrics.StoreCollector) -> None:
    while True:
        await store.refresh()
        collector.update(store.stats())
        await asyncio.sleep(METRICS_REFRESH_S)


async def serve(config: KVStoreConfig, stop: asyncio.Event) -> None:
    store = build_store(config)
    collector = metrics.StoreCollector(store.stats())
    REGISTRY.register(collector)
    start_metrics_server(config, config.kvstore_metrics_port)
    service = GrpcService(
        "kvstore",
        [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name],
        access=InternalSecurity.from_config(config),
    )
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(
        KVStoreServicer(store, max_lease_ttl_s=config.kvstore_max_lease_ttl_s), service.server
    )
    await service.start(config.bind_host, config.kvstore_port)
    refresher = asyncio.create_task(_refresh_metrics(store, collector))
    await service.set_serving(True)
    try:
        await stop.wait()
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        await service.stop()
        await store.close()
        REGISTRY.unregister(collector)
