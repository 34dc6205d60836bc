"""Prefix caching: hits, the num_tokens - 1 cap, eviction order, salts, hash stability."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvmesh.scheduler.kv_cache_manager import KVCacheManager
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash
from tests.scheduler.factories import make_request, make_scheduler, run_step

SYSTEM_PROMPT = list(range(500, 540))  # 40 tokens: 2 full blocks of 16 + 8


def _finish_prefill(sched, request) -> None:
    sched.add_request(request)
    while request.num_computed_tokens < request.num_prompt_tokens:
        run_step(sched)


def test_second_request_with_the_same_prefix_skips_its_full_blocks() -> None:
    sched = make_scheduler()
    _finish_prefill(sched, make_request(40, max_tokens=50, prompt_token_ids=SYSTEM_PROMPT))
    second = make_request(45, prompt_token_ids=[*SYSTEM_PROMPT, 1, 2, 3, 4, 5])
    sched.add_request(second)
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens[second.request_id] == 45 - 32
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 32
    first_blocks = sched.get_block_ids(out.scheduled_cached_reqs.req_ids[0])
    assert new.block_ids[:2] == first_blocks[:2]  # shared physical blocks
    second_output = next(o for o in outputs if o.request_id == second.request_id)
    assert second_output.num_cached_tokens == 32
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 45, 32)
    sched.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    # 32 tokens = 2 full blocks, both cached; at most 31 may hit, i.e. 1 block.
    sched = make_scheduler()
    prompt = SYSTEM_PROMPT[:32]
    _finish_prefill(sched, make_request(32, max_tokens=50, prompt_token_ids=prompt))
    again = make_request(32, prompt_token_ids=prompt)
    sched.add_request(again)
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens[again.request_id] == 16
    assert again.num_cached_tokens == 16
    assert [o.new_token_ids for o in outputs if o.request_id == again.request_id] == [[7]]


def test_prefix_caching_off_computes_everything() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    _finish_prefill(sched, make_request(40, max_tokens=50, prompt_token_ids=SYSTEM_PROMPT))
    second = make_request(40, prompt_token_ids=SYSTEM_PROMPT)
    sched.add_request(second)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens[second.request_id] == 40
    assert sched.make_stats().prefix_cache_hits == 0


def test_cache_salt_isolates_prefixes() -> None:
    sched = make_scheduler()
    _finish_prefill(
        sched,
        make_request(40, max_tokens=50, prompt_token_ids=SYSTEM_PROMPT, cache_salt="alice"),
    )
    bob = make_request(40, prompt_token_ids=SYSTEM_PROMPT, cache_salt="bob")
    unsalted = make_request(40, prompt_token_ids=SYSTEM_PROMPT)
    alice = make_request(40, prompt_token_ids=SYSTEM_PROMPT, cache_salt="alice")
    for req in (bob, unsalted, alice):
        sched.add_request(req)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens[bob.request_id] == 40
    assert out.num_scheduled_tokens[unsalted.request_id] == 40
    assert out.num_scheduled_tokens[alice.request_id] == 8


def _manager_with_cached(num_blocks: int, *prompts: list[int]) -> KVCacheManager:
    """Each prompt is computed in full, cached and freed, in the given order."""
    kv = KVCacheManager(num_blocks, block_size=4)
    for prompt in prompts:
        req = make_request(len(prompt), prompt_token_ids=prompt)
        assert kv.allocate_slots(req, len(prompt)) is not None
        kv.cache_full_blocks(req, len(prompt))
        kv.free(req)
    kv.check_integrity()
    return kv


def _num_hit_tokens(kv: KVCacheManager, prompt: list[int]) -> int:
    # One extra token so the cap does not hide the last full block.
    return kv.get_computed_blocks(make_request(0, prompt_token_ids=[*prompt, 0]))[1]


def test_a_freed_sequence_loses_its_tail_first() -> None:
    seq = list(range(12))  # 3 full blocks
    kv = _manager_with_cached(3, seq)
    tail_hash = make_request(12, prompt_token_ids=seq)
    kv.update_block_hashes(tail_hash)
    other = make_request(4, prompt_token_ids=[90, 91, 92, 93])
    new_blocks = kv.allocate_slots(other, 4)
    assert new_blocks is not None
    # The reused block was seq's last one; its old hash is gone from the cache.
    assert kv.block_pool.get_cached_block(tail_hash.block_hashes[2]) is None
    assert new_blocks[0].block_hash is None
    assert _num_hit_tokens(kv, seq) == 8
    kv.check_integrity()


def test_least_recently_freed_sequence_is_evicted_first() -> None:
    older, newer = list(range(8)), list(range(100, 108))
    kv = _manager_with_cached(4, older, newer)
    fresh = make_request(8, prompt_token_ids=list(range(200, 208)))
    assert kv.allocate_slots(fresh, 8) is not None
    assert _num_hit_tokens(kv, older) == 0
    assert _num_hit_tokens(kv, newer) == 8


def test_blocks_no_prefix_can_hit_are_reused_before_cached_ones() -> None:
    # 4 blocks of 4: `cached` fills 2; `partial` (6 tokens) leaves 1 full
    # block cached and 1 partial block uncached. Freed last, the partial block
    # is still handed out first: no cached prefix is evicted while it is free.
    cached, partial = list(range(8)), list(range(100, 106))
    kv = _manager_with_cached(4, cached)
    req = make_request(6, prompt_token_ids=partial)
    assert kv.allocate_slots(req, 6) is not None
    kv.cache_full_blocks(req, 6)
    partial_block = kv.get_blocks(req.request_id)[1]
    assert partial_block.block_hash is None
    kv.free(req)
    kv.check_integrity()
    other = make_request(4, prompt_token_ids=[50, 51, 52, 53])
    assert kv.allocate_slots(other, 4) == [partial_block]
    assert _num_hit_tokens(kv, cached) == 8
    assert _num_hit_tokens(kv, partial) == 4
    kv.check_integrity()


def test_a_hit_on_a_free_block_takes_it_off_the_free_queue() -> None:
    seq = list(range(8))
    kv = _manager_with_cached(4, seq)
    assert kv.block_pool.get_num_free_blocks() == 4
    req = make_request(9, prompt_token_ids=[*seq, 8])
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert num_hit_tokens == 8
    assert kv.allocate_slots(req, 1, hits) is not None
    assert kv.block_pool.get_num_free_blocks() == 1
    assert [b.ref_cnt for b in hits[0]] == [1, 1]
    # The remaining free block is handed out; the hit blocks stay cached.
    other = make_request(4, prompt_token_ids=[50, 51, 52, 53])
    assert kv.allocate_slots(other, 4) is not None
    assert kv.allocate_slots(make_request(1), 1) is None
    assert all(b.block_hash is not None for b in hits[0])
    kv.check_integrity()


def test_shared_blocks_are_counted_once_per_holder() -> None:
    seq = list(range(8))
    kv = _manager_with_cached(6, seq)
    holders = [make_request(9, prompt_token_ids=[*seq, i]) for i in range(3)]
    for req in holders:
        hits, _ = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, 1, hits) is not None
    assert [b.ref_cnt for b in kv.get_blocks(holders[0].request_id)[:2]] == [3, 3]
    kv.check_integrity()
    for req in holders:
        kv.free(req)
    assert kv.usage == 0.0
    kv.check_integrity()


_HASH_SCRIPT = """
import json, sys
from kvmesh.services.contracts.block_hash import extend_block_hashes, sha256_block_hash
hashes = []
extend_block_hashes(hashes, list(range(40)), 16, "salt", sha256_block_hash)
print(json.dumps([h.hex() for h in hashes]))
"""


def test_block_hashes_are_the_same_in_other_processes() -> None:
    here: list[bytes] = []
    extend_block_hashes(here, list(range(40)), 16, "salt", sha256_block_hash)
    assert len(here) == 2 and here[0] != here[1]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert json.loads(result.stdout) == [h.hex() for h in here]


def test_block_hash_chains_the_parent_and_tokens() -> None:
    tokens = list(range(16))
    root = sha256_block_hash(None, tokens)
    assert sha256_block_hash(root, tokens) != root
    assert sha256_block_hash(None, [*tokens[:-1], 99]) != root
    assert sha256_block_hash(None, tokens, ("salt",)) != root
    assert sha256_block_hash(None, tokens) == root
