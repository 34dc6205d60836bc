"""Config validation, admission checks, abort/finish in every state, the step
contract (new vs cached requests), and stats."""

from __future__ import annotations

import pytest

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.services.contracts.finish_reason import FinishReason
from tests.scheduler.factories import make_output, make_request, make_scheduler, run_step


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"policy": "lifo"}, "policy"),
        ({"watermark": 1.0}, "watermark"),
        ({"long_prefill_token_threshold": -5}, "long_prefill_token_threshold"),
        ({"prefix_hash": "md5"}, "prefix_hash"),
        ({"num_kv_blocks": 10, "max_model_len": 2048}, "max_model_len"),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{"num_kv_blocks": 1024, **overrides})


def test_requests_that_could_never_run_are_rejected() -> None:
    sched = make_scheduler(max_model_len=64, num_kv_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(65))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request(0))
    req = make_request(8, request_id="dup")
    sched.add_request(req)
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request(make_request(8, request_id="dup"))
    assert sched.num_waiting == 1


def test_new_requests_travel_in_full_then_only_deltas() -> None:
    sched = make_scheduler(block_size=4)
    req = make_request(6, max_tokens=10, ignore_eos=True)
    sched.add_request(req)
    out, _ = run_step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.prompt_token_ids == req.prompt_token_ids
    assert new.output_token_ids == []
    assert len(new.block_ids) == 2
    assert out.scheduled_cached_reqs.num_reqs == 0
    # 7 tokens fit in 2 blocks; the 9th token needs a third.
    block_deltas = []
    for _ in range(3):
        out, _ = run_step(sched)
        assert out.scheduled_new_reqs == []
        block_deltas.append(
            (
                out.scheduled_cached_reqs.num_computed_tokens[0],
                len(out.scheduled_cached_reqs.new_block_ids[0]),
            )
        )
    assert block_deltas == [(6, 0), (7, 0), (8, 1)]
    assert sched.get_block_ids(req.request_id)[:2] == new.block_ids
    assert len(sched.get_block_ids(req.request_id)) == 3


def test_abort_in_every_state_frees_blocks_and_tells_the_worker_when_needed() -> None:
    sched = make_scheduler(num_kv_blocks=5, block_size=4, max_model_len=20, watermark=0.0)
    running = make_request(8, max_tokens=8, ignore_eos=True)
    preempted = make_request(8, max_tokens=8, ignore_eos=True)
    sched.add_request(running)
    sched.add_request(preempted)
    run_step(sched)
    run_step(sched)  # the second one is preempted for lack of blocks
    waiting = make_request(4)
    sched.add_request(waiting)
    assert preempted.status == RequestStatus.PREEMPTED
    assert running.status == RequestStatus.RUNNING
    assert waiting.status == RequestStatus.WAITING

    ids = [running.request_id, preempted.request_id, waiting.request_id, "unknown"]
    assert sched.abort_requests(ids) == ids[:3]
    assert sched.abort_requests(ids) == []
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in (running, waiting))
    out = sched.schedule()
    # Only the running one is still held by the worker (preempted was dropped already).
    assert out.finished_req_ids == {running.request_id}
    assert out.total_num_scheduled_tokens == 0
    sched.check_integrity()


def test_abort_between_schedule_and_update_drops_the_late_result() -> None:
    sched = make_scheduler()
    req, other = make_request(4), make_request(4)
    sched.add_request(req)
    sched.add_request(other)
    out = sched.schedule()
    sched.abort_requests(req.request_id)
    outputs = sched.update_from_output(out, make_output(out, scheduler=_Snapshot(out)))
    assert [o.request_id for o in outputs] == [other.request_id]
    assert sched.get_request(req.request_id) is None


class _Snapshot:
    """Lets make_output fabricate tokens for requests the scheduler already dropped."""

    def __init__(self, out) -> None:
        self.requests = {
            n.req_id: _Counts(n.num_computed_tokens, len(n.prompt_token_ids))
            for n in out.scheduled_new_reqs
        }


class _Counts:
    def __init__(self, num_computed_tokens: int, num_tokens: int) -> None:
        self.num_computed_tokens, self.num_tokens = num_computed_tokens, num_tokens


def test_finish_requests_on_a_stop_string() -> None:
    sched = make_scheduler()
    req = make_request(4, max_tokens=10)
    sched.add_request(req)
    run_step(sched)
    assert sched.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED) == [
        req.request_id
    ]
    assert req.status.finish_reason is FinishReason.STOP
    assert sched.schedule().finished_req_ids == {req.request_id}
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests([req.request_id], RequestStatus.RUNNING)


def test_mismatched_step_ids_are_refused() -> None:
    sched = make_scheduler()
    sched.add_request(make_request(4))
    out = sched.schedule()
    wrong = make_output(out, scheduler=sched)
    wrong.step_id += 1
    with pytest.raises(ValueError, match="step"):
        sched.update_from_output(out, wrong)


def test_stats_report_gauges_counters_and_latencies() -> None:
    now = [100.0]
    sched = make_scheduler(clock=lambda: now[0])
    req = make_request(4, max_tokens=3, arrival_time=99.0)
    sched.add_request(req)
    for t in (100.0, 100.25, 101.0):
        now[0] = t
        run_step(sched)
    waiting = make_request(4, max_tokens=3, arrival_time=101.5)
    sched.add_request(waiting)
    now[0] = 102.0
    sched.abort_requests(waiting.request_id)
    stats = sched.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.prefix_cache_queries == 4
    finished = {f.request_id: f for f in stats.finished_requests}
    done = finished[req.request_id]
    assert done.finish_reason is FinishReason.LENGTH
    assert (done.queue_time, done.prefill_time, done.decode_time) == (1.0, 0.0, 1.0)
    assert done.num_generation_tokens == 3
    aborted = finished[waiting.request_id]
    assert aborted.finish_reason is FinishReason.ABORT
    assert (aborted.queue_time, aborted.prefill_time, aborted.decode_time) == (None, None, None)
    # Counters restart after each snapshot.
    again = sched.make_stats()
    assert (again.prefix_cache_queries, again.finished_requests) == (0, [])


def test_status_order_makes_finished_a_comparison() -> None:
    order = list(RequestStatus)
    assert order == sorted(order)
    assert [s.is_finished() for s in order] == [False] * 4 + [True] * 4
