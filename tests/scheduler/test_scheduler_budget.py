"""Token budget, chunked prefill, long-prefill threshold, max_num_seqs, watermark."""

from __future__ import annotations

from kvmesh.scheduler.config import DEFAULT_STEP_TOKEN_BUDGET, SchedulerConfig, step_token_budget
from tests.scheduler.factories import make_request, make_scheduler, run_step


def test_running_decodes_come_first_and_a_new_prompt_gets_the_rest() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    a, b = make_request(8, ignore_eos=True), make_request(8, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {a.request_id: 8, b.request_id: 8}

    c = make_request(100, ignore_eos=True)
    sched.add_request(c)
    steps = [run_step(sched)[0].num_scheduled_tokens for _ in range(4)]
    assert steps == [
        {a.request_id: 1, b.request_id: 1, c.request_id: 30},
        {a.request_id: 1, b.request_id: 1, c.request_id: 30},
        {a.request_id: 1, b.request_id: 1, c.request_id: 30},
        {a.request_id: 1, b.request_id: 1, c.request_id: 10},
    ]
    # c samples only once its whole prompt is computed.
    assert c.num_output_tokens == 1
    assert a.num_output_tokens == b.num_output_tokens == 5


def test_chunked_prefill_spans_steps_and_reports_progress() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    req = make_request(100)
    sched.add_request(req)
    seen = []
    for _ in range(4):
        out, outputs = run_step(sched)
        seen.append(
            (
                out.num_scheduled_tokens[req.request_id],
                len(out.scheduled_new_reqs),
                list(out.scheduled_cached_reqs.num_computed_tokens),
                [o.new_token_ids for o in outputs],
            )
        )
    assert seen == [
        (32, 1, [], []),
        (32, 0, [32], []),
        (32, 0, [64], []),
        (4, 0, [96], [[7]]),
    ]
    assert out.total_num_scheduled_tokens == 4


def test_long_prefill_threshold_caps_each_prompt_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=20)
    a, b = make_request(50), make_request(50)
    sched.add_request(a)
    sched.add_request(b)
    steps = [run_step(sched)[0].num_scheduled_tokens for _ in range(4)]
    ids = (a.request_id, b.request_id)
    assert steps == [dict.fromkeys(ids, n) for n in (20, 20, 10, 1)]


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(4, max_tokens=2, ignore_eos=True) for _ in range(3)]
    for req in reqs:
        sched.add_request(req)
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == [reqs[0].request_id, reqs[1].request_id]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, _ = run_step(sched)  # both reach max_tokens=2 here
    assert len(out.num_scheduled_tokens) == 2
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {reqs[2].request_id: 4}
    assert out.finished_req_ids == {reqs[0].request_id, reqs[1].request_id}


def _watermark_scheduler():
    # 100 blocks of 16 tokens, 10 kept free when admitting behind running work.
    return make_scheduler(
        num_kv_blocks=100, watermark=0.1, max_model_len=1600, max_num_batched_tokens=4096
    )


def test_admission_keeps_watermark_blocks_free() -> None:
    sched = _watermark_scheduler()
    big = make_request(60 * 16)  # 60 blocks; nothing runs yet, so no watermark
    too_big = make_request(31 * 16)  # would leave 9 < 10 blocks
    sched.add_request(big)
    sched.add_request(too_big)
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == [big.request_id]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 40
    out, _ = run_step(sched)  # big's first decode takes a 61st block
    assert list(out.num_scheduled_tokens) == [big.request_id]
    assert too_big.request_id not in out.num_scheduled_tokens


def test_admission_may_use_everything_above_the_watermark() -> None:
    sched = _watermark_scheduler()
    big = make_request(60 * 16)
    fits = make_request(30 * 16)  # leaves exactly 10 blocks
    sched.add_request(big)
    sched.add_request(fits)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {big.request_id: 960, fits.request_id: 480}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 10


def test_watermark_does_not_block_a_request_that_runs_alone() -> None:
    # The whole pool, with a watermark: admitted because nobody else runs.
    sched = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=16, watermark=0.5)
    req = make_request(16, max_tokens=1)
    sched.add_request(req)
    _, outputs = run_step(sched)
    assert outputs[0].finish_reason is not None


def test_the_step_budget_is_the_flag_else_the_workers_else_the_default() -> None:
    assert step_token_budget(4096, 1024) == 4096  # --max-num-batched-tokens wins
    assert step_token_budget(0, 1024) == 1024  # 0 (its default): the worker's
    assert step_token_budget(0, 0) == DEFAULT_STEP_TOKEN_BUDGET == 2048  # no preference
    # What a library user gets without the service.
    assert SchedulerConfig(num_kv_blocks=128).max_num_batched_tokens == 2048
