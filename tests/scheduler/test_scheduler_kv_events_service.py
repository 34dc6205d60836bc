"""The publisher seals one batch per event-loop turn, hands a subscriber its catch-up
and then every live batch with nothing lost or repeated, and drops one that lags."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.protos import scheduler_pb2
from kvmesh.scheduler.kv_events import AllBlocksCleared, BlockStored, KVEventLog
from kvmesh.scheduler.kv_events_service import KVEventPublisher, ReplicaLoad, attach_publisher
from tests.scheduler.factories import make_request, make_scheduler, run_step


def make_publisher(cached: list[bytes] | None = None) -> KVEventPublisher:
    return KVEventPublisher(KVEventLog(), 16, lambda: ReplicaLoad(1, 2, 3, 4), lambda: cached or [])


def stored(name: str) -> BlockStored:
    return BlockStored((name.encode(),), None)


def sequences(batches: list[scheduler_pb2.KVEventBatch]) -> list[int]:
    return [batch.sequence for batch in batches]


def drain(queue: asyncio.Queue) -> list:
    return [queue.get_nowait() for _ in range(queue.qsize())]


async def test_events_of_one_loop_turn_form_one_batch() -> None:
    publisher = make_publisher()
    _, catch_up, queue = publisher.subscribe(0, 0)
    assert [b.resync for b in catch_up] == [True]
    publisher.record(stored("a"))
    publisher.record(AllBlocksCleared())
    await asyncio.sleep(0)
    publisher.record(stored("b"))
    await asyncio.sleep(0)
    batches = drain(queue)
    assert sequences(batches) == [1, 2]
    assert [e.WhichOneof("event") for e in batches[0].events] == ["stored", "all_cleared"]
    assert batches[0].events[0].stored.block_size == 16
    assert batches[0].load == scheduler_pb2.ReplicaLoad(
        num_running=1, num_waiting=2, num_active_blocks=3, num_kv_blocks=4
    )


async def test_a_subscriber_catches_up_then_follows_without_loss_or_repeat() -> None:
    publisher = make_publisher()
    key, _, first = publisher.subscribe(0, 0)
    publisher.record(stored("a"))
    await asyncio.sleep(0)
    publisher.record(stored("b"))  # not sealed yet when the second one subscribes
    _, catch_up, second = publisher.subscribe(1, publisher.log.instance_id)
    publisher.record(stored("c"))
    await asyncio.sleep(0)
    assert sequences(catch_up) == [1, 2]
    assert sequences(drain(second)) == [3]
    assert sequences(drain(first)) == [1, 2, 3]
    publisher.unsubscribe(key)
    publisher.record(stored("d"))
    await asyncio.sleep(0)
    assert drain(first) == []


async def test_a_subscriber_that_lags_too_far_is_dropped(monkeypatch) -> None:
    monkeypatch.setattr("kvmesh.scheduler.kv_events_service.MAX_SUBSCRIBER_BACKLOG", 3)
    publisher = make_publisher()
    _, _, slow = publisher.subscribe(0, 0)
    for name in "abcd":
        publisher.record(stored(name))
        await asyncio.sleep(0)
    assert [b and b.sequence for b in drain(slow)] == [1, 2, 3, None]
    publisher.record(stored("e"))
    await asyncio.sleep(0)
    assert drain(slow) == []


async def test_attached_publisher_reports_the_schedulers_cache_and_load() -> None:
    scheduler = make_scheduler(num_kv_blocks=16, block_size=4, max_model_len=32)
    publisher = attach_publisher(scheduler)
    with pytest.raises(RuntimeError, match="once"):
        attach_publisher(scheduler)
    scheduler.add_request(make_request(9, max_tokens=4))
    scheduler.add_request(make_request(9, max_tokens=4))
    run_step(scheduler)
    run_step(scheduler)
    assert publisher.load_report().load == scheduler_pb2.ReplicaLoad(
        num_running=2, num_waiting=0, num_active_blocks=6, num_kv_blocks=16
    )
    _, catch_up, _ = publisher.subscribe(0, 0)
    snapshot = {h for b in catch_up for e in b.events for h in e.stored.block_hashes}
    assert snapshot == set(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert len(snapshot) == 4


async def test_the_load_counts_the_blocks_queued_requests_will_need() -> None:
    """A queue holds no blocks yet, but a router must see it as load."""
    scheduler = make_scheduler(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_seqs=1)
    publisher = attach_publisher(scheduler)
    scheduler.add_request(make_request(9, max_tokens=4))  # 3 blocks once admitted
    scheduler.add_request(make_request(13, max_tokens=4))  # 4 blocks
    assert publisher.load_report().load.num_waiting_blocks == 7
    run_step(scheduler)  # admits the first only (max_num_seqs=1)
    load = publisher.load_report().load
    assert (load.num_running, load.num_waiting, load.num_waiting_blocks) == (1, 1, 4)
    assert load.num_active_blocks == 3


async def test_queued_requests_do_not_count_the_prefix_the_replica_has_cached() -> None:
    scheduler = make_scheduler(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_seqs=1)
    publisher = attach_publisher(scheduler)
    first = make_request(13, max_tokens=4)
    scheduler.add_request(first)
    run_step(scheduler)  # computes and caches its 3 full prompt blocks
    prompt = [*first.prompt_token_ids[:12], 7, 7, 7]  # 4 blocks, 3 of them cached
    scheduler.add_request(make_request(15, max_tokens=4, prompt_token_ids=prompt))
    assert publisher.load_report().load.num_waiting_blocks == 1
