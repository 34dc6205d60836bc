"""The scheduler half of the KV connector, without a scheduler or a store."""

from __future__ import annotations

import pytest

from kvmesh.scheduler.block_pool import KVCacheBlock
from kvmesh.scheduler.kv_connector import KVConnectorScheduler
from kvmesh.scheduler.request import Request
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import KVConnectorOutput

BLOCK = 4


def _request(num_tokens: int, request_id: str = "r") -> Request:
    request = Request(
        request_id,
        list(range(100, 100 + num_tokens)),
        SamplingParams(max_tokens=8),
        eos_token_ids=(),
        arrival_time=0.0,
    )
    extend_block_hashes(request.block_hashes, request.all_token_ids, BLOCK, None, sha256_block_hash)
    return request


def test_matched_tokens_count_only_known_leading_blocks_after_local_hits() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(21)  # 5 full blocks
    hashes = request.block_hashes
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    connector.record_stored(hashes[:2] + hashes[3:])  # block 2 missing
    assert connector.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    # Asking twice changes nothing (side-effect free).
    assert connector.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    # After one local hit, block 1 is the only stored one before the gap.
    assert connector.get_num_new_matched_tokens(request, BLOCK) == (BLOCK, True)
    connector.record_stored(hashes[2:3])
    assert connector.get_num_new_matched_tokens(request, 0) == (5 * BLOCK, True)


def test_matched_tokens_stop_where_local_caching_would_recompute_anyway() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(4 * BLOCK)  # exactly 4 blocks: the last one holds the last token
    connector.record_stored(request.block_hashes)
    # Local hits stop at (num_tokens - 1) // block_size = 3 blocks.
    assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, True)
    assert connector.get_num_new_matched_tokens(request, 3 * BLOCK) == (0, False)


def test_load_round_trip_and_short_load_forgets_the_missing_block() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(21)
    connector.record_stored(request.block_hashes)
    num_tokens, _ = connector.get_num_new_matched_tokens(request, BLOCK)
    assert num_tokens == 4 * BLOCK
    connector.update_state_after_alloc(request, [10, 11, 12, 13], BLOCK, num_tokens)
    assert connector.is_loading("r") and connector.has_pending_work()
    meta = connector.build_connector_meta()
    assert [t.req_id for t in meta.loads] == ["r"]
    assert meta.loads[0].block_ids == [10, 11, 12, 13]
    assert meta.loads[0].block_hashes == request.block_hashes[1:5]
    assert connector.build_connector_meta().is_empty()  # handed over once
    load = connector.finish_load("r", 2)
    assert load is not None and load.num_local_computed_tokens == BLOCK
    assert not connector.is_loading("r")
    # Block 3 (index 1 + 2) was missing: later lookups stop before it.
    assert connector.num_stored_prefix_blocks(request.block_hashes) == 3
    assert connector.finish_load("r", 4) is None  # reported twice: ignored
    stats = connector.make_stats()
    assert (stats.loads_started, stats.blocks_requested, stats.blocks_loaded) == (1, 4, 2)
    assert stats.loads_short == 1


def test_reserving_the_wrong_number_of_blocks_is_refused() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(21)
    with pytest.raises(ValueError):
        connector.update_state_after_alloc(request, [1, 2], 0, 3 * BLOCK)


def test_cancelled_loads_are_not_sent_and_their_reports_are_ignored() -> None:
    connector = KVConnectorScheduler(BLOCK)
    first, second, third = _request(9, "a"), _request(9, "b"), _request(9, "c")
    connector.record_stored(first.block_hashes + second.block_hashes + third.block_hashes)
    connector.update_state_after_alloc(first, [1, 2], 0, 2 * BLOCK)
    connector.cancel_load("a")
    assert not connector.is_loading("a") and connector.build_connector_meta().is_empty()
    connector.update_state_after_alloc(second, [3, 4], 0, 2 * BLOCK)
    connector.build_connector_meta()
    connector.cancel_load("b")  # sent: the worker drops it when told
    assert connector.finish_load("b", 2) is None
    connector.update_state_after_alloc(third, [5, 6], 0, 2 * BLOCK)
    assert connector.reset() == ["c"] and not connector.has_pending_work()


def test_saves_skip_known_blocks_and_each_hash_is_saved_once() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(13)  # 3 full blocks
    connector.record_stored(request.block_hashes[1:2])
    connector.on_blocks_cached(request, [KVCacheBlock(i) for i in (7, 8, 9)], 0, 3)
    meta = connector.build_connector_meta()
    assert len(meta.saves) == 1
    assert meta.saves[0].block_ids == [7, 9]
    assert meta.saves[0].block_hashes == [request.block_hashes[0], request.block_hashes[2]]
    # The same blocks cached again (another request, same prefix): nothing to save.
    connector.on_blocks_cached(_request(13, "twin"), [KVCacheBlock(i) for i in (1, 2, 3)], 0, 3)
    assert connector.build_connector_meta().is_empty()
    first, last = meta.saves[0].block_hashes
    connector.update_connector_output(
        KVConnectorOutput(saved_block_hashes=[first], failed_save_hashes=[last])
    )
    stats = connector.make_stats()
    assert (stats.blocks_saved_planned, stats.blocks_saved_confirmed, stats.failed_saves) == (
        2,
        1,
        1,
    )
    # The failed block is no longer believed stored: cached again, it is saved again.
    assert connector.num_stored_prefix_blocks(request.block_hashes) == 2
    connector.on_blocks_cached(request, [KVCacheBlock(i) for i in (7, 8, 9)], 0, 3)
    assert connector.build_connector_meta().saves[0].block_hashes == [last]


def test_known_hashes_are_bounded_least_recent_first() -> None:
    connector = KVConnectorScheduler(BLOCK, max_known_hashes=3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    connector.record_stored(hashes[:3])
    connector.record_stored(hashes[:1])  # refreshes hash 0
    connector.record_stored(hashes[3:])
    assert connector.num_stored_prefix_blocks([hashes[0]]) == 1
    assert connector.num_stored_prefix_blocks([hashes[1]]) == 0
    assert connector.num_stored_prefix_blocks(hashes[3:]) == 2


def _saving(connector: KVConnectorScheduler, request: Request) -> list[bytes]:
    """Plan the saves of every full block of ``request``; their hashes."""
    num_blocks = len(request.block_hashes)
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    connector.on_blocks_cached(request, blocks, 0, num_blocks)
    return [h for t in connector.build_connector_meta().saves for h in t.block_hashes]


def test_a_wait_for_saves_settles_once_each_hash_is_saved_or_failed() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(13)  # 3 full blocks
    hashes = _saving(connector, request)
    assert not connector.wait_for_saves("p", hashes[:2])
    assert connector.has_pending_work()  # reports only come back with steps
    connector.update_connector_output(KVConnectorOutput(saved_block_hashes=hashes[:1]))
    assert connector.pop_settled_save_waits() == []
    # A failure settles too: the wait is over, the lease will tell what is stored.
    connector.update_connector_output(KVConnectorOutput(failed_save_hashes=hashes[1:2]))
    assert connector.pop_settled_save_waits() == ["p"]
    assert connector.pop_settled_save_waits() == []
    assert not connector.has_pending_work()


def test_nothing_in_flight_means_nothing_to_wait_for() -> None:
    connector = KVConnectorScheduler(BLOCK)
    request = _request(9)
    connector.record_stored(request.block_hashes)  # known stored: no save planned
    assert _saving(connector, request) == []
    assert connector.wait_for_saves("p", request.block_hashes)
    assert not connector.has_pending_work() and connector.pop_settled_save_waits() == []


def test_saves_reported_before_the_wait_opens_are_not_waited_for() -> None:
    connector = KVConnectorScheduler(BLOCK)
    hashes = _saving(connector, _request(9))
    connector.update_connector_output(KVConnectorOutput(saved_block_hashes=hashes))
    assert connector.wait_for_saves("p", hashes)


def test_waits_share_hashes_and_a_cancelled_wait_is_never_reported() -> None:
    connector = KVConnectorScheduler(BLOCK)
    hashes = _saving(connector, _request(9))
    assert not connector.wait_for_saves("a", hashes)
    assert not connector.wait_for_saves("b", hashes[:1])
    assert not connector.wait_for_saves("gone", hashes)
    connector.cancel_save_wait("gone")
    connector.update_connector_output(KVConnectorOutput(saved_block_hashes=hashes[:1]))
    assert connector.pop_settled_save_waits() == ["b"]
    connector.update_connector_output(KVConnectorOutput(saved_block_hashes=hashes[1:]))
    assert connector.pop_settled_save_waits() == ["a"]
    assert not connector.has_pending_work()


def test_a_lost_worker_settles_every_wait() -> None:
    connector = KVConnectorScheduler(BLOCK)
    hashes = _saving(connector, _request(9))
    assert not connector.wait_for_saves("p", hashes)
    connector.reset()
    assert connector.pop_settled_save_waits() == ["p"]
    # Its saves will never be reported: a new wait on them has nothing to wait for.
    assert connector.wait_for_saves("q", hashes)
