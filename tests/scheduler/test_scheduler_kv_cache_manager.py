"""KVCacheManager owns block arithmetic: exact block counts at block boundaries,
the decode fast path, and caching only the blocks a step newly fills."""

from __future__ import annotations

import pytest

from kvmesh.scheduler.block_pool import KVCacheIntegrityError
from kvmesh.scheduler.kv_cache_manager import KVCacheManager
from kvmesh.scheduler.request import Request
from tests.scheduler.factories import make_request

BLOCK_SIZE = 4


def _admit(kv: KVCacheManager, request: Request, num_tokens: int) -> int:
    """Allocate for the first ``num_tokens`` and count them computed; return blocks taken."""
    new_blocks = kv.allocate_slots(request, num_tokens)
    assert new_blocks is not None
    request.num_computed_tokens = num_tokens
    return len(new_blocks)


def _computed_and_cached(kv: KVCacheManager, prompt: list[int]) -> Request:
    """A request whose whole prompt is computed and whose full blocks are cached."""
    request = make_request(len(prompt), prompt_token_ids=prompt)
    _admit(kv, request, len(prompt))
    kv.cache_full_blocks(request, len(prompt))
    return request


@pytest.mark.parametrize(
    ("num_prompt_tokens", "num_blocks"),
    [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)],
)
def test_a_prompt_gets_exactly_the_blocks_its_tokens_need(num_prompt_tokens, num_blocks) -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request(num_prompt_tokens)
    assert _admit(kv, request, num_prompt_tokens) == num_blocks
    assert kv.block_pool.get_num_free_blocks() == 8 - num_blocks
    kv.check_integrity(holders=[request])


@pytest.mark.parametrize(
    ("num_computed", "num_new_tokens", "num_new_blocks"),
    [
        (5, 3, 0),  # 8 tokens: the two held blocks are exactly full
        (8, 1, 1),  # the 9th token opens a third block
        (6, 6, 1),  # 12 tokens: one more block, exactly full
        (6, 7, 2),  # 13 tokens: two more
    ],
)
def test_growth_takes_new_blocks_only_past_a_boundary(
    num_computed, num_new_tokens, num_new_blocks
) -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request(num_computed)
    _admit(kv, request, num_computed)
    held = len(kv.get_blocks(request.request_id))
    new_blocks = kv.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None and len(new_blocks) == num_new_blocks
    assert kv.get_blocks(request.request_id)[held:] == new_blocks
    request.num_computed_tokens += num_new_tokens
    kv.check_integrity(holders=[request])


def test_the_decode_fast_path_needs_no_free_block() -> None:
    # The pool is exhausted, yet a decode that fits in its last block proceeds.
    kv = KVCacheManager(2, BLOCK_SIZE)
    request = make_request(5)
    _admit(kv, request, 5)
    assert kv.block_pool.get_num_free_blocks() == 0
    assert kv.allocate_slots(request, 3) == []
    # Held room is answered before the pool is consulted, watermark included.
    assert kv.allocate_slots(request, 3, num_watermark_blocks=1) == []
    assert kv.allocate_slots(request, 4) is None  # the 9th token needs a block
    assert len(kv.get_blocks(request.request_id)) == 2
    kv.check_integrity(holders=[request])


def test_the_watermark_keeps_blocks_back_from_admissions() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE)
    request = make_request(8)
    assert kv.allocate_slots(request, 8, num_watermark_blocks=3) is None
    assert kv.get_blocks(request.request_id) == []  # a refusal changes nothing
    assert kv.allocate_slots(request, 8, num_watermark_blocks=2) is not None
    kv.check_integrity()


def test_prefix_hits_are_refused_for_a_request_that_holds_blocks() -> None:
    prompt = list(range(9))
    kv = KVCacheManager(8, BLOCK_SIZE)
    _computed_and_cached(kv, prompt)
    second = make_request(9, prompt_token_ids=prompt)
    hits, _ = kv.get_computed_blocks(second)
    _admit(kv, second, 1)
    with pytest.raises(ValueError, match="prefix hits come at admission"):
        kv.allocate_slots(second, 8, hits)


class _RecordingPool:
    """Wraps BlockPool.cache_full_blocks to record which block ranges get registered."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._cache_full_blocks = kv.block_pool.cache_full_blocks
        kv.block_pool.cache_full_blocks = self._record  # type: ignore[method-assign]

    def _record(
        self, blocks, block_hashes, num_cached_blocks: int, num_full_blocks: int, group: int = 0
    ) -> None:
        self.ranges.append((num_cached_blocks, num_full_blocks))
        self._cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, group)


def test_cache_full_blocks_registers_only_newly_full_blocks() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    pool = _RecordingPool(kv)
    request = make_request(12)
    _admit(kv, request, 12)
    for num_computed in (3, 4, 4, 7, 12, 12):
        kv.cache_full_blocks(request, num_computed)
    assert pool.ranges == [(0, 1), (1, 3)]
    blocks = kv.get_blocks(request.request_id)
    assert all(block.block_hash is not None for block in blocks)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    kv.check_integrity(holders=[request])


def test_cache_full_blocks_skips_the_prefix_hits() -> None:
    prompt = list(range(10))
    kv = KVCacheManager(8, BLOCK_SIZE)
    first = _computed_and_cached(kv, prompt)
    pool = _RecordingPool(kv)
    second = make_request(12, prompt_token_ids=[*prompt, 10, 11])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert kv.allocate_slots(second, 4, hits) == kv.get_blocks(second.request_id)[2:]
    second.num_computed_tokens = 12
    kv.cache_full_blocks(second, 12)
    assert pool.ranges == [(2, 3)]
    kv.check_integrity(holders=[first, second])


def test_cache_full_blocks_is_a_no_op_without_prefix_caching() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, enable_caching=False)
    request = make_request(8)
    _admit(kv, request, 8)
    kv.cache_full_blocks(request, 8)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert request.block_hashes == []


def test_check_integrity_catches_blocks_that_do_not_match_the_holders() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    holder, stray = make_request(4), make_request(4)
    _admit(kv, holder, 4)
    _admit(kv, stray, 4)
    kv.check_integrity(holders=[holder, stray])
    with pytest.raises(KVCacheIntegrityError, match="blocks held by"):
        kv.check_integrity(holders=[holder])
    holder.num_computed_tokens = 5  # computed past its only block
    with pytest.raises(KVCacheIntegrityError, match="holds only 1 blocks"):
        kv.check_integrity(holders=[holder, stray])
    kv.free(stray)
    holder.num_computed_tokens = 4
    kv.check_integrity(holders=[holder])
