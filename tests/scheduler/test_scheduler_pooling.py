"""Pooling requests: whole prompts in one step, no KV blocks, finished with their vector."""

from __future__ import annotations

import pytest

from kvmesh.scheduler.output import FinishReason
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from tests.scheduler.factories import make_request, make_scheduler


def _pooled(step: SchedulerOutput, errors: dict[str, str] | None = None) -> ModelRunnerOutput:
    out = ModelRunnerOutput.make_empty(step.step_id)
    failed = errors or {}
    out.pooled = {
        rid: bytes([n % 256]) * 4
        for rid, n in step.num_scheduled_tokens.items()
        if rid not in failed
    }
    out.errors = dict(failed)
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_whole_prompts_packed_under_the_budget_without_blocks(async_scheduling: bool) -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        async_scheduling=async_scheduling,
        pooling=True,
    )
    requests = [make_request(n, pooling=PoolingParams()) for n in (30, 20, 40, 10)]
    for r in requests:
        scheduler.add_request(r)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    step = scheduler.schedule()
    # 30 + 20 fit; 40 does not fit what is left and holds the line (never chunked).
    assert step.num_scheduled_tokens == {requests[0].request_id: 30, requests[1].request_id: 20}
    assert all(not r.block_ids for r in step.scheduled_new_reqs)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    if async_scheduling:
        # The next step runs while this one is in flight; the first two are not rerun.
        assert scheduler.schedule().num_scheduled_tokens == {
            requests[2].request_id: 40,
            requests[3].request_id: 10,
        }
    outputs = scheduler.update_from_output(step, _pooled(step))
    assert [o.request_id for o in outputs] == [requests[0].request_id, requests[1].request_id]
    assert all(o.finish_reason is FinishReason.STOP and o.pooled_data for o in outputs)
    assert outputs[0].pooled_data == bytes([30]) * 4
    assert requests[0].request_id in scheduler.schedule().finished_req_ids
    scheduler.check_integrity()


def test_worker_failure_fails_the_request_alone() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64, pooling=True)
    a, b = make_request(5, pooling=PoolingParams()), make_request(6, pooling=PoolingParams())
    scheduler.add_request(a)
    scheduler.add_request(b)
    step = scheduler.schedule()
    outputs = scheduler.update_from_output(step, _pooled(step, {a.request_id: "too long"}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id[a.request_id].finish_reason is FinishReason.ERROR
    assert by_id[b.request_id].finish_reason is FinishReason.STOP
    assert not scheduler.has_unfinished_requests()


def test_pooling_prompt_over_max_model_len_is_refused() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64, pooling=True)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request(65, pooling=PoolingParams()))


def test_a_runner_takes_only_its_kind_of_request() -> None:
    pooling = make_scheduler(max_num_batched_tokens=64, max_model_len=64, pooling=True)
    with pytest.raises(ValueError, match="pooling model"):
        pooling.add_request(make_request(5))
    generating = make_scheduler()
    with pytest.raises(ValueError, match="generation model"):
        generating.add_request(make_request(5, pooling=PoolingParams()))
