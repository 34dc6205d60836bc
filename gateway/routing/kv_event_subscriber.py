"""Follow one replica's KVEvents stream into the router, reconnecting as needed.

Run one ``follow_kv_events`` task per replica; cancel it when the replica
leaves or the gateway stops. A gap in the stream reopens it at once from the
last batch applied (the scheduler replays or resyncs); a broken stream
reopens after ``retry_delay_s``. The replica stays routable meanwhile:
readiness decides that, and a stale index only costs hits.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh.gateway.routing.replica_feed import KVEventGap
from kvmesh.gateway.routing.router import Router
from kvmesh.protos import scheduler_pb2_grpc

logger = logging.getLogger(__name__)


async def follow_kv_events(
    router: Router,
    name: str,
    stub: scheduler_pb2_grpc.KVEventsStub,
    subscriber: str = "gateway",
    retry_delay_s: float = 0.5,
) -> None:
    """Apply ``name``'s KV events to ``router`` until cancelled or the replica is removed."""
    while router.has_replica(name):
        call = stub.StreamKVEvents(router.resume_request(name, subscriber))
        try:
            async for batch in call:
                if not router.has_replica(name):
                    return
                router.apply_kv_events(name, batch)
        except KVEventGap as gap:
            logger.info("replica %s: KV events %s; reopening the stream", name, gap)
            continue
        except grpc.aio.AioRpcError as error:
            logger.warning(
                "replica %s: KV event stream broke (%s: %s); retrying in %.1fs",
                name,
                error.code().name,
                error.details(),
                retry_delay_s,
            )
        finally:
            call.cancel()
        await asyncio.sleep(retry_delay_s)
