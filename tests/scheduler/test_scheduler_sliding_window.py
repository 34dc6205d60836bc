"""KV-cache groups with sliding windows (vLLM v1's hybrid KV-cache manager):
blocks that left the window go back to the pool while the request runs, their
table entries become the null block, admission counts window-sized needs, and
prefix hits, preemption and the worker's per-group tables keep working."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.kv_cache_manager import KVCacheManager
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.kv_cache_groups import (
    group_layers,
    layer_slots,
    longest_fitting_len,
    num_skipped_blocks,
    windows_from_wire,
)
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from tests.scheduler.factories import (
    make_output,
    make_request,
    make_scheduler,
    random_workload,
    run_step,
)
from tests.scheduler.test_scheduler_async import EOS, drive, greedy_token

BLOCK_SIZE = 4
NULL = 0  # the null block's id


# ---- grouping layers ---------------------------------------------------------


def test_one_attention_type_is_one_group_of_every_layer() -> None:
    for window in (None, 4096):
        groups = group_layers([window] * 30)
        assert [(g.sliding_window, g.layers) for g in groups] == [(window, tuple(range(30)))]
        assert layer_slots(groups, 30) == [(0, layer) for layer in range(30)]


def test_alternating_layers_make_two_groups_of_equal_size_full_attention_first() -> None:
    # Gemma 2: even layers slide, odd ones attend to everything.
    windows = [4096 if layer % 2 == 0 else None for layer in range(26)]
    groups = group_layers(windows)
    assert [g.sliding_window for g in groups] == [None, 4096]
    assert groups[0].layers == tuple(range(1, 26, 2))
    assert groups[1].layers == tuple(range(0, 26, 2))
    slots = layer_slots(groups, 26)
    assert slots[0] == (1, 0) and slots[1] == (0, 0) and slots[25] == (0, 12)


def test_a_five_to_one_pattern_splits_the_windowed_layers_into_groups_of_the_full_size() -> None:
    # Gemma 3 1B: 26 layers, every sixth global.
    windows = [None if (layer + 1) % 6 == 0 else 512 for layer in range(26)]
    groups = group_layers(windows)
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert groups[0].sliding_window is None
    assert sorted(layer for g in groups for layer in g.layers) == list(range(26))
    # Every layer has a tensor pair below the group size, none shared inside a group.
    assert {slot for slot in layer_slots(groups, 26)} == {
        (g, j) for g, group in enumerate(groups) for j in range(len(group.layers))
    }


@pytest.mark.parametrize(
    ("num_computed", "expected"),
    [(0, 0), (7, 0), (8, 0), (10, 0), (11, 1), (14, 1), (15, 2), (40, 8)],
)
def test_skipped_blocks_are_those_before_the_first_key_any_later_query_reads(
    num_computed: int, expected: int
) -> None:
    # Window 8: the query at 11 reads keys 4..11, so block 0 (0..3) is out.
    assert num_skipped_blocks(num_computed, 8, BLOCK_SIZE) == expected
    assert num_skipped_blocks(num_computed, None, BLOCK_SIZE) == 0


# ---- the manager ---------------------------------------------------------------


def _decode_through(kv: KVCacheManager, request, num_tokens: int) -> list[int]:
    """Allocate one token at a time (computing it) up to ``num_tokens``; the
    used-block count after each allocation."""
    used: list[int] = []
    while request.num_computed_tokens < num_tokens:
        assert kv.allocate_slots(request, 1) is not None
        used.append(kv.block_pool.get_num_used_blocks())
        request.num_computed_tokens += 1
        kv.cache_full_blocks(request, request.num_computed_tokens)
        kv.check_integrity()
    return used


def test_blocks_leave_the_table_as_the_window_slides() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, group_windows=(8,))
    request = make_request(40)
    used = _decode_through(kv, request, 40)
    table = kv.get_block_ids(request.request_id)
    # The last query (position 39) read 32..39: blocks 8 and 9 only.
    assert len(table) == 10
    assert table[:8] == [NULL] * 8 and NULL not in table[8:]
    # Never more than the window's two blocks plus the one a window edge straddles.
    assert max(used) == 3
    assert kv.block_pool.get_num_used_blocks() == 2
    kv.free(request)
    assert kv.block_pool.get_num_used_blocks() == 0
    kv.check_integrity()


def test_the_null_block_is_never_handed_out() -> None:
    kv = KVCacheManager(5, BLOCK_SIZE, group_windows=(8,))
    assert kv.block_pool.get_num_free_blocks() == 4
    request = make_request(16)
    assert kv.allocate_slots(request, 16) is not None
    assert NULL not in kv.get_block_ids(request.request_id)
    assert kv.allocate_slots(make_request(1), 1) is None
    kv.check_integrity()


def test_full_attention_alone_reserves_no_null_block() -> None:
    kv = KVCacheManager(5, BLOCK_SIZE)
    assert kv.block_pool.null_block is None
    assert kv.block_pool.get_num_free_blocks() == 5


def test_every_group_gets_its_own_blocks_from_the_one_pool() -> None:
    kv = KVCacheManager(32, BLOCK_SIZE, group_windows=(None, 8))
    request = make_request(24)
    new_blocks = kv.allocate_slots(request, 24)
    assert new_blocks is not None and len(new_blocks) == 6
    full = kv.get_block_ids(request.request_id)
    (windowed,) = kv.get_group_block_ids(request.request_id)
    assert len(full) == len(windowed) == 6 and not set(full) & set(windowed)
    assert kv.get_new_group_block_ids(request.request_id, 6) == [windowed]
    request.num_computed_tokens = 24
    kv.cache_full_blocks(request, 24)
    # The next allocation frees the windowed group's blocks 0..3, not the full group's.
    assert kv.allocate_slots(request, 1) is not None
    assert kv.get_group_block_ids(request.request_id)[0][:4] == [NULL] * 4
    assert NULL not in kv.get_block_ids(request.request_id)
    assert kv.block_pool.get_num_used_blocks() == 7 + 3
    kv.check_integrity(holders=[request])


def test_a_prefix_hit_with_a_window_needs_only_the_blocks_inside_it() -> None:
    prompt = list(range(100, 124))  # 6 blocks
    kv = KVCacheManager(10, BLOCK_SIZE, group_windows=(8,))
    first = make_request(24, prompt_token_ids=prompt)
    _decode_through(kv, first, 24)
    kv.free(first)
    # Blocks 0..3 were freed as the window slid (oldest first), blocks 4, 5 at
    # the end. A new request takes 4 blocks: the 3 never used, then block 0's.
    other = make_request(16)
    assert kv.allocate_slots(other, 16) is not None
    kv.free(other)
    again = make_request(25, prompt_token_ids=[*prompt, 7])
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    # Full attention would have no hit (block 0 is gone); the window needs
    # only the two blocks before position 24.
    assert num_hit_tokens == 24
    assert [b.block_id for b in hits[0][:4]] == [NULL] * 4
    assert kv.allocate_slots(again, 1, hits) is not None
    assert kv.get_block_ids(again.request_id)[:4] == [NULL] * 4
    kv.check_integrity(holders=[again])


def test_a_windowed_hit_shortens_to_where_the_window_blocks_are_all_cached() -> None:
    prompt = list(range(100, 124))
    kv = KVCacheManager(16, BLOCK_SIZE, group_windows=(None, 8))
    first = make_request(24, prompt_token_ids=prompt)
    assert kv.allocate_slots(first, 24) is not None
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first, 24)
    second = make_request(25, prompt_token_ids=[*prompt, 7])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 24 and len(hits) == 2
    assert NULL not in [b.block_id for b in hits[0]]
    assert [b.block_id for b in hits[1]][:4] == [NULL] * 4
    kv.check_integrity(holders=[first])


def test_a_windowed_hit_ends_after_the_last_cached_window() -> None:
    prompt = list(range(100, 124))
    kv = KVCacheManager(12, BLOCK_SIZE, group_windows=(8,))
    first = make_request(24, prompt_token_ids=prompt)
    assert kv.allocate_slots(first, 24) is not None
    first.num_computed_tokens = 24
    kv.cache_full_blocks(first, 24)
    # Shares blocks 0..2 only: the scan from the right finds its last window there.
    second = make_request(25, prompt_token_ids=[*prompt[:12], *range(500, 513)])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 12
    assert [b.block_id for b in hits[0]][:1] == [NULL]
    assert hits[0][1:] == kv.get_blocks(first.request_id)[1:3]


# ---- the scheduler --------------------------------------------------------------


def _long_requests(sched: Scheduler, n: int, prompt_len: int, max_tokens: int) -> list:
    requests = [make_request(prompt_len, max_tokens=max_tokens, ignore_eos=True) for _ in range(n)]
    for request in requests:
        sched.add_request(request)
    return requests


def _run(sched: Scheduler) -> int:
    """Run to completion; the most blocks held at once."""
    peak = 0
    while sched.has_unfinished_requests():
        run_step(sched)
        sched.check_integrity()
        peak = max(peak, sched.kv_cache_manager.block_pool.get_num_used_blocks())
    return peak


def test_more_requests_run_at_once_with_a_window_than_with_full_attention() -> None:
    common = dict(num_kv_blocks=41, block_size=BLOCK_SIZE, max_model_len=64, watermark=0.0)
    full = make_scheduler(**common)
    windowed = make_scheduler(**common, kv_cache_windows=(8,))
    for sched in (full, windowed):
        _long_requests(sched, 4, 20, 40)
        _run(sched)
    stats_full, stats_windowed = full.make_stats(), windowed.make_stats()
    assert stats_full.num_preemptions > 0
    assert stats_windowed.num_preemptions == 0


def test_admission_counts_only_the_window_of_a_queued_request() -> None:
    sched = make_scheduler(
        num_kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=64, kv_cache_windows=(None, 8)
    )
    request = make_request(40)
    sched.add_request(request)
    # Full group: 10 blocks; windowed group: the blocks the last query still reads.
    assert sched.num_waiting_blocks() == 10 + (10 - num_skipped_blocks(39, 8, BLOCK_SIZE))


def test_a_preempted_windowed_request_resumes_and_finishes() -> None:
    sched = make_scheduler(
        num_kv_blocks=16,
        block_size=BLOCK_SIZE,
        max_model_len=40,
        watermark=0.0,
        max_num_batched_tokens=8,
        kv_cache_windows=(None, 8),
    )
    requests = _long_requests(sched, 2, 8, 12)
    _run(sched)
    assert sum(r.num_preemptions for r in requests) >= 1
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert all(r.num_output_tokens == 12 for r in requests)
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0


def test_a_2000_token_request_with_a_256_token_window_holds_the_window_and_one_block() -> None:
    """The issue's memory bar: read the pool's used blocks at every step."""
    block_size = 16
    window = 256
    sched = make_scheduler(
        num_kv_blocks=400,
        block_size=block_size,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=block_size,
        kv_cache_windows=(window,),
    )
    request = make_request(1744, max_tokens=256, ignore_eos=True)
    sched.add_request(request)
    used: list[int] = []
    while sched.has_unfinished_requests():
        run_step(sched)
        sched.check_integrity()
        used.append(sched.kv_cache_manager.block_pool.get_num_used_blocks())
    assert request.num_tokens == 2000
    # At most the window plus one block (the one being written), for the
    # whole run; a full-attention group would have ended at 125 blocks.
    assert max(used) == window // block_size + 1
    assert len(used) > 100


def test_a_windowed_prompt_chunk_holds_the_window_plus_the_chunk() -> None:
    block_size, window, chunk = 16, 256, 512
    sched = make_scheduler(
        num_kv_blocks=400,
        block_size=block_size,
        max_model_len=2048,
        long_prefill_token_threshold=chunk,
        kv_cache_windows=(window,),
    )
    sched.add_request(make_request(2000, max_tokens=1, ignore_eos=True))
    peak = _run(sched)
    assert peak <= cdiv(window, block_size) + cdiv(chunk, block_size) + 1


def test_the_kv_connector_refuses_a_windowed_cache_by_name() -> None:
    with pytest.raises(ValueError, match="does not move sliding-window"):
        SchedulerConfig(
            num_kv_blocks=64,
            enable_prefix_caching=True,
            enable_kv_connector=True,
            kv_cache_windows=(None, 8),
        )


def test_a_pool_too_small_for_one_request_in_every_group_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than the"):
        SchedulerConfig(
            num_kv_blocks=20,
            block_size=BLOCK_SIZE,
            max_model_len=64,
            max_num_batched_tokens=8,
            kv_cache_windows=(None, 8),
        )


def test_windows_from_the_wire_default_to_one_full_attention_group() -> None:
    assert windows_from_wire([]) == (None,)
    assert windows_from_wire([0, 512, 512]) == (None, 512, 512)


def test_the_longest_length_a_pool_serves_counts_every_group() -> None:
    # Full attention alone: the pool's tokens, as without groups.
    assert longest_fitting_len((None,), 4096, 64, 16, 2048) == 1024
    # A window alone: any length, once the window and a chunk fit.
    assert longest_fitting_len((256,), 4096, 64, 16, 512) == 4096
    # Full + window: the full group's share is what is left after the window's.
    windows = (None, 256)
    length = longest_fitting_len(windows, 4096, 200, 16, 512)
    assert length == (200 - 1 - (16 + 32 + 1)) * 16
    SchedulerConfig(
        num_kv_blocks=200,
        block_size=16,
        max_model_len=length,
        max_num_batched_tokens=512,
        kv_cache_windows=windows,
    )


# ---- random workloads: invariants and the worker's per-group view -------------------


class GroupWorker:
    """Keeps per-group block tables from the step messages alone, like the worker."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}
        self.num_computed: dict[str, int] = {}

    def apply(self, sched: Scheduler, out) -> None:
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
            self.num_computed.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(new.block_ids), *map(list, new.group_block_ids)]
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        groups = cached.new_group_block_ids or [[] for _ in cached.req_ids]
        for req_id, new_blocks, group_blocks in zip(
            cached.req_ids, cached.new_block_ids, groups, strict=True
        ):
            tables = self.tables[req_id]
            tables[0].extend(new_blocks)
            for table, ids in zip(tables[1:], group_blocks, strict=True):
                assert len(ids) == len(new_blocks)
                table.extend(ids)
        kv = sched.kv_cache_manager
        windows = sched.config.kv_cache_windows
        pool_blocks = kv.block_pool.blocks
        readers: dict[int, int] = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            start = self.num_computed[req_id]
            for group, window in enumerate(windows):
                table = self.tables[req_id][group]
                live = kv.get_blocks(req_id, group)
                assert len(table) == len(live)
                assert len(table) * BLOCK_SIZE >= start + num_tokens
                # Every block this step's queries read or write is the
                # scheduler's live block there, never the null block.
                first = num_skipped_blocks(start, window, BLOCK_SIZE)
                for index in range(first, len(table)):
                    assert table[index] == live[index].block_id != NULL
                    readers[table[index]] = readers.get(table[index], 0) + 1
            self.num_computed[req_id] = start + num_tokens
        for block_id, count in readers.items():
            assert count == 1 or pool_blocks[block_id].block_hash is not None


add_op = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 16), st.booleans())
step_op = st.tuples(st.just("step"), st.integers(0, 6))
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(st.one_of(add_op, step_op, step_op, abort_op), max_size=60),
    windows=st.sampled_from([(6,), (9,), (None, 6), (None, 5, 9)]),
    caching=st.booleans(),
    budget=st.sampled_from([4, 9, 32]),
)
def test_random_windowed_workloads_keep_every_invariant(
    operations, windows, caching, budget
) -> None:
    sched = make_scheduler(
        num_kv_blocks=len(windows) * 12 + 1,
        block_size=BLOCK_SIZE,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        kv_cache_windows=windows,
        watermark=0.1,
    )
    worker = GroupWorker()
    shared = list(range(300, 330))
    submitted = []
    for op in operations:
        if op[0] == "add":
            _, n_prompt, max_tokens, share = op
            prompt = shared[:n_prompt] if share else None
            request = make_request(n_prompt, max_tokens=max_tokens, prompt_token_ids=prompt)
            sched.add_request(request)
            submitted.append(request.request_id)
        elif op[0] == "step":
            out = sched.schedule()
            worker.apply(sched, out)
            token = 2 if op[1] == 0 else 10 + op[1]
            result = make_output(
                out, dict.fromkeys(out.num_scheduled_tokens, token), scheduler=sched
            )
            sched.update_from_output(out, result)
        elif submitted:
            sched.abort_requests(submitted[op[1] % len(submitted)])
        sched.check_integrity()
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0


# ---- KV content: sync and async, with a worker that checks what each window reads ------


class WindowedKVWorker:
    """Applies SchedulerOutputs in order like the worker, with a table per
    KV-cache group: each step writes its tokens' slots in every group and checks
    that every slot a query's window reads holds that position's own prefix,
    written by that group (tests/scheduler/test_scheduler_async.py's check,
    per group and per window)."""

    def __init__(self, windows: tuple[int | None, ...]) -> None:
        self.windows = windows
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.tables: dict[str, list[list[int]]] = {}
        # slot -> (group, the token prefix ending at that slot's position)
        self.kv: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.total_num_scheduled_tokens:
            self.num_steps += 1
        for req_id in out.finished_req_ids:
            for state in (self.tokens, self.num_computed, self.tables):
                state.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.tables[new.req_id] = [list(new.block_ids), *map(list, new.group_block_ids)]
        cached = out.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            assert cached.num_computed_tokens[index] == self.num_computed[req_id]
            groups = cached.new_group_block_ids[index] if cached.new_group_block_ids else []
            tables = self.tables[req_id]
            tables[0].extend(cached.new_block_ids[index])
            for table, ids in zip(tables[1:], groups, strict=True):
                table.extend(ids)
        req_ids, sampled = [], []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            sequence = self.tokens[req_id]
            start = self.num_computed[req_id]
            end = start + num_scheduled
            assert end <= len(sequence)
            for group, window in enumerate(self.windows):
                table = self.tables[req_id][group]
                for position in range(start, end):
                    block = table[position // BLOCK_SIZE]
                    assert block != NULL, f"{req_id}: writes into the null block"
                    slot = block * BLOCK_SIZE + position % BLOCK_SIZE
                    self.kv[slot] = (group, tuple(sequence[: position + 1]))
                first = 0 if window is None else max(start - window + 1, 0)
                for position in range(first, end):
                    slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                    assert self.kv.get(slot) == (group, tuple(sequence[: position + 1])), (
                        f"{req_id}: group {group} reads stale KV at position {position}"
                    )
            self.num_computed[req_id] = end
            req_ids.append(req_id)
            if end == len(sequence):
                token = greedy_token(tuple(sequence))
                sequence.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)


@pytest.mark.parametrize("windows", [(6,), (None, 6), (None, 5, 9)])
@pytest.mark.parametrize("seed", range(8))
def test_windows_read_only_their_own_kv_sync_and_async(windows, seed: int) -> None:
    """Random workloads (prefix hits, chunks, preemption) in both modes: the
    same tokens, and every slot a window reads was written for its position."""
    specs, config = random_workload(random.Random(seed), BLOCK_SIZE)
    config.update(
        num_kv_blocks=max(config["num_kv_blocks"], 8) * len(windows) + 1,
        kv_cache_windows=windows,
    )
    runs = {}
    for async_scheduling in (False, True):
        sched = make_scheduler(async_scheduling=async_scheduling, **config)
        arrivals: dict[int, list] = {}
        for req_id, prompt, max_tokens, ignore_eos, arrival in specs:
            request = make_request(
                len(prompt),
                max_tokens,
                request_id=req_id,
                prompt_token_ids=prompt,
                eos_token_ids=(EOS,),
                ignore_eos=ignore_eos,
            )
            arrivals.setdefault(arrival, []).append(request)
        runs[async_scheduling] = drive(sched, WindowedKVWorker(windows), arrivals)
        assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    assert runs[True].tokens == runs[False].tokens
    assert set(runs[True].finish) == {spec[0] for spec in specs}
