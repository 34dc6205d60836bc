"""A scheduler's KVEvents stream over real gRPC keeps the gateway router's index equal
to its prefix cache; after the stream breaks, the router catches up by replay; a load
change reaches the router without any event."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.kv_event_subscriber import follow_kv_events
from kvmesh.gateway.routing.prefix_index import block_key
from kvmesh.gateway.routing.router import Router
from kvmesh.protos import scheduler_pb2, scheduler_pb2_grpc
from kvmesh.scheduler.kv_events_service import KVEventsServicer, attach_publisher
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH
from kvmesh.services.runtime.grpc_server import GrpcService, internal_channel
from tests.scheduler.factories import make_request, make_scheduler, run_step

BLOCK_SIZE = 4


async def start_server(servicer: KVEventsServicer, port: int = 0) -> GrpcService:
    service = GrpcService(
        "scheduler", [scheduler_pb2.DESCRIPTOR.services_by_name["KVEvents"].full_name]
    )
    scheduler_pb2_grpc.add_KVEventsServicer_to_server(servicer, service.server)
    await service.start("127.0.0.1", port)
    return service


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def serve_requests(scheduler: Scheduler, first_user: int, num_users: int) -> None:
    for user in range(first_user, first_user + num_users):
        prompt = list(range(2000, 2012)) + [user] * 9
        scheduler.add_request(make_request(0, max_tokens=3, prompt_token_ids=prompt))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)


def index_matches(router: Router, scheduler: Scheduler) -> bool:
    cached = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    return router.index.keys_of(router.replica("r0").slot) == {block_key(h) for h in cached}


async def test_router_follows_a_scheduler_across_a_broken_stream(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh.scheduler.kv_events_service")
    scheduler = make_scheduler(num_kv_blocks=24, block_size=BLOCK_SIZE, max_model_len=32)
    publisher = attach_publisher(scheduler)
    servicer = KVEventsServicer(publisher)
    service = await start_server(servicer)
    port = service.port
    router = Router(RouterConfig(block_size=BLOCK_SIZE))
    router.add_replica("r0")
    channel = internal_channel(f"127.0.0.1:{port}", NO_INTERNAL_AUTH)
    follower = asyncio.create_task(
        follow_kv_events(router, "r0", scheduler_pb2_grpc.KVEventsStub(channel), retry_delay_s=0.05)
    )
    try:
        serve_requests(scheduler, 0, 3)
        await wait_for(lambda: publisher.log.last_sequence > 0 and index_matches(router, scheduler))
        assert router.pick(list(range(2000, 2012)) + [99] * 9).num_overlap_blocks == 3

        await service.stop(grace=0)
        seen = router.replica("r0").feed.last_sequence
        serve_requests(scheduler, 3, 6)  # evicts some of the first users' blocks
        await asyncio.sleep(0)
        seen_after = publisher.log.last_sequence
        assert seen_after > seen
        service = await start_server(servicer, port)
        await wait_for(lambda: index_matches(router, scheduler))
        assert router.replica("r0").feed.instance_id == publisher.log.instance_id
        replayed = [re.search(r"(\d+) batches replayed", r.getMessage()) for r in caplog.records]
        assert [int(m[1]) for m in replayed if m] == [seen_after - seen]

        # No event, but the load changed: a load report tells the router.
        scheduler.add_request(make_request(5, max_tokens=3))
        scheduler.schedule()
        await wait_for(lambda: router.replica("r0").num_requests == 1)
    finally:
        follower.cancel()
        await channel.close()
        await service.stop(grace=0)


async def test_gateway_follows_kv_events_only_while_it_has_a_choice() -> None:
    """One replica: no KV event stream (every request goes to it). A second one
    joins: both are followed, the first from a resync of what it cached
    meanwhile. Back to one: the stream closes and its index slot is dropped."""
    from kvmesh.gateway.engine.routed_client import RoutedEngineClient
    from kvmesh.services.contracts.replica_set import ReplicaAddress
    from tests.gateway.test_gateway_routed_engine_client import (
        INFO,
        FakeReplica,
        PushedDiscovery,
    )

    schedulers, publishers, services, addresses = [], [], [], {}
    for name in ("a", "b"):
        scheduler = make_scheduler(num_kv_blocks=24, block_size=BLOCK_SIZE, max_model_len=32)
        publisher = attach_publisher(scheduler)
        service = await start_server(KVEventsServicer(publisher))
        schedulers.append(scheduler)
        publishers.append(publisher)
        services.append(service)
        addresses[name] = ReplicaAddress(name, f"127.0.0.1:{service.port}", "127.0.0.1:1")
    discovery = PushedDiscovery()
    discovery.sets.put_nowait(frozenset([addresses["a"]]))
    replicas = {n: FakeReplica(decode=lambda ids: "x", info=INFO) for n in "ab"}
    engine = RoutedEngineClient(discovery, lambda a: replicas[a.name], "kv", 0.01)
    num_subscribers = [lambda p=p: len(p._subscribers) for p in publishers]
    try:
        await engine.start(timeout=5)
        serve_requests(schedulers[0], 0, 3)  # cached blocks nobody is told about
        await asyncio.sleep(0.2)
        assert num_subscribers[0]() == 0
        assert engine.router.index.keys_of(engine.router.replica("a").slot) == set()

        discovery.sets.put_nowait(frozenset(addresses.values()))
        await wait_for(lambda: engine.router.has_replica("b"))
        await wait_for(lambda: num_subscribers[0]() == 1 and num_subscribers[1]() == 1)
        cached = schedulers[0].kv_cache_manager.block_pool.cached_block_hash_to_block
        await wait_for(
            lambda: (
                engine.router.index.keys_of(engine.router.replica("a").slot)
                == {block_key(h) for h in cached}
            )
        )

        discovery.sets.put_nowait(frozenset([addresses["a"]]))
        await wait_for(lambda: not engine.router.has_replica("b"))
        await wait_for(lambda: num_subscribers[0]() == 0 and num_subscribers[1]() == 0)
        assert engine.router.index.keys_of(engine.router.replica("a").slot) == set()
    finally:
        await engine.close()
        for service in services:
            await service.stop(grace=0)
