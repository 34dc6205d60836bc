"""The block pool reports every prefix-cache change; the event log numbers, keeps and
replays them: a reconnect gets exactly the batches missed, one too far behind a resync."""

from __future__ import annotations

import pytest

from kvmesh.scheduler.block_pool import BlockPool
from kvmesh.scheduler.kv_events import (
    RESYNC_BLOCKS_PER_BATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    make_resync_batches,
)
from kvmesh.services.contracts.block_hash import BlockHash, extend_block_hashes, sha256_block_hash
from tests.scheduler.factories import make_request, make_scheduler, run_step

BLOCK_SIZE = 4
# What the block pool hands its sink.
Event = BlockStored | BlockRemoved | AllBlocksCleared


def chain(tokens: list[int], salt: str | None = None) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK_SIZE, salt, sha256_block_hash)
    return hashes


def cache_sequence(pool: BlockPool, hashes: list[BlockHash]) -> None:
    """Compute a whole sequence into fresh blocks, register it, and free it (it stays cached)."""
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes))
    pool.free_blocks(reversed(blocks))


def apply_events(contents: set[BlockHash], events: list[Event]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            contents.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            contents.difference_update(event.block_hashes)
        else:
            contents.clear()


def test_pool_reports_stored_chains_evictions_and_resets() -> None:
    events: list[Event] = []
    pool = BlockPool(4, event_sink=events.append)
    first = chain(list(range(12)))
    cache_sequence(pool, first)
    assert events == [BlockStored(tuple(first), None)]

    events.clear()
    # A second sequence needs two blocks: the two least recently freed (the
    # tail of the first sequence, freed first) are evicted.
    second = chain(list(range(100, 108)))
    cache_sequence(pool, second)
    assert events == [BlockRemoved((first[2],)), BlockStored(tuple(second), None)]

    events.clear()
    pool.reset_prefix_cache()
    assert events == [AllBlocksCleared()]


def test_stored_runs_split_where_content_was_already_cached_and_carry_their_parent() -> None:
    events: list[Event] = []
    pool = BlockPool(8, event_sink=events.append)
    hashes = chain(list(range(16)))
    # Block 1's content is already cached in another block (another request
    # computed the same prefix at the same time).
    cache_sequence(pool, hashes[:2])
    events.clear()
    blocks = pool.get_new_blocks(4)
    held = pool.get_cached_block(hashes[0])
    assert held is not None
    pool.touch([held])
    pool.cache_full_blocks([held, *blocks[1:]], hashes, 0, 4)
    assert events == [BlockStored((hashes[2], hashes[3]), hashes[1])]
    # Block 1's copy in blocks[1] stayed uncached: nothing to report for it.


def test_events_of_a_running_scheduler_rebuild_its_prefix_cache() -> None:
    scheduler = make_scheduler(num_kv_blocks=12, block_size=BLOCK_SIZE, max_model_len=40)
    log = KVEventLog()
    scheduler.kv_cache_manager.block_pool.event_sink = log.record
    shared = list(range(500, 512))
    for index in range(8):
        scheduler.add_request(make_request(5, max_tokens=6, prompt_token_ids=shared + [index] * 5))
        for _ in range(4):
            run_step(scheduler)
        if index == 5:
            scheduler.reset_prefix_cache()
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    contents: set[BlockHash] = set()
    while (batch := log.seal()) is not None:
        apply_events(contents, list(batch.events))
    assert contents == set(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert contents, "the workload cached nothing: the test would prove nothing"


def stored(*names: str) -> BlockStored:
    return BlockStored(tuple(name.encode() for name in names), None)


def fill(log: KVEventLog, num_batches: int) -> list[KVEventBatch]:
    batches = []
    for index in range(num_batches):
        log.record(stored(f"b{index}"))
        batch = log.seal()
        assert batch is not None
        batches.append(batch)
    return batches


def no_snapshot() -> list[BlockHash]:
    raise AssertionError("a replay must not take a snapshot")


def test_batches_are_numbered_from_one_and_empty_steps_seal_nothing() -> None:
    log = KVEventLog(clock=lambda: 42.0)
    assert log.seal() is None
    log.record(stored("a"))
    log.record(AllBlocksCleared())
    assert log.seal() == KVEventBatch(1, (stored("a"), AllBlocksCleared()), 42.0)
    assert log.seal() is None
    assert fill(log, 2)[-1].sequence == 3


def test_reconnect_from_a_sequence_gets_exactly_the_batches_missed() -> None:
    log = KVEventLog()
    batches = fill(log, 10)
    assert log.catch_up(4, log.instance_id, no_snapshot) == batches[3:]
    assert log.catch_up(11, log.instance_id, no_snapshot) == []
    assert log.catch_up(1, log.instance_id, no_snapshot) == batches


def test_subscriber_too_far_behind_gets_a_clear_and_a_snapshot() -> None:
    # Room for three one-block batches: batches 1..7 fall out of the buffer.
    log = KVEventLog(max_replay_blocks=3, clock=lambda: 7.0)
    fill(log, 10)
    assert log.oldest_replayable == 8
    assert log.catch_up(8, log.instance_id, no_snapshot)[0].sequence == 8
    cached = [b"x", b"y"]
    answer = log.catch_up(7, log.instance_id, lambda: cached)
    assert answer == [
        KVEventBatch(10, (AllBlocksCleared(), BlockStored((b"x", b"y"), None)), 7.0, resync=True)
    ]


@pytest.mark.parametrize("instance_id", [0, 12345])
def test_a_subscriber_of_another_instance_is_resynced(instance_id: int) -> None:
    log = KVEventLog(instance_id=99)
    fill(log, 2)
    answer = log.catch_up(3, instance_id, lambda: [b"x"])
    assert [batch.resync for batch in answer] == [True]
    assert answer[0].sequence == 2


def test_catch_up_refuses_while_events_are_unsealed() -> None:
    log = KVEventLog()
    log.record(stored("a"))
    with pytest.raises(RuntimeError, match="seal"):
        log.catch_up(1, log.instance_id, lambda: [])


def test_a_batch_larger_than_the_buffer_still_replays() -> None:
    log = KVEventLog(max_replay_blocks=2)
    fill(log, 1)
    log.record(stored("a", "b", "c", "d"))
    big = log.seal()
    assert log.catch_up(2, log.instance_id, no_snapshot) == [big]
    assert log.oldest_replayable == 2


def test_resync_snapshots_are_cut_into_bounded_batches() -> None:
    hashes = [bytes([i]) for i in range(10)]
    batches = make_resync_batches(5, hashes, 1.0, blocks_per_batch=4)
    assert [len(b.events) for b in batches] == [2, 1, 1]
    assert all(b.resync and b.sequence == 5 for b in batches)
    assert batches[0].events[0] == AllBlocksCleared()
    contents: set[BlockHash] = {b"stale"}
    for batch in batches:
        apply_events(contents, list(batch.events))
    assert contents == set(hashes)
    default_parts = make_resync_batches(5, hashes * RESYNC_BLOCKS_PER_BATCH, 1.0)
    assert len(default_parts) == 10
    assert make_resync_batches(0, [], 1.0) == [
        KVEventBatch(0, (AllBlocksCleared(),), 1.0, resync=True)
    ]
