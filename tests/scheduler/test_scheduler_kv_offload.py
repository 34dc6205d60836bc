"""The scheduler with its KV connector: loads, saves and every way a load can end.

A fake store (a set of hashes) and a fake worker stand in for the kvstore and
the worker half; ``check_integrity`` runs after every step.
"""

from __future__ import annotations

from kvmesh.services.contracts.step import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from tests.scheduler.factories import make_output, make_request, make_scheduler

BLOCK = 4
PROMPT = list(range(500, 530))  # 30 tokens: 7 full blocks


def _scheduler(**config: object):
    return make_scheduler(
        block_size=BLOCK, num_kv_blocks=64, max_model_len=128, enable_kv_connector=True, **config
    )


def _step(
    scheduler, loads: dict[str, int] | None = None, saved: list[bytes] | None = None
) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    out = scheduler.schedule()
    result = make_output(out, scheduler=scheduler)
    result.kv_connector_output = KVConnectorOutput(
        finished_loads=dict(loads or {}), saved_block_hashes=list(saved or [])
    )
    scheduler.update_from_output(out, result)
    scheduler.check_integrity()
    return out, result


def _run_to_end(scheduler, max_steps: int = 100) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not scheduler.has_connector_work():
            return outs
        outs.append(_step(scheduler)[0])
    raise AssertionError("did not finish")


def _saved_hashes(outs: list[SchedulerOutput]) -> list[bytes]:
    return [h for out in outs for t in out.kv_connector_metadata.saves for h in t.block_hashes]


def test_every_full_block_is_saved_once_after_it_is_computed() -> None:
    scheduler = _scheduler()
    first = make_request(0, max_tokens=3, prompt_token_ids=PROMPT)
    scheduler.add_request(first)
    outs = _run_to_end(scheduler)
    # 30 prompt + 2 appended tokens computed = 32 = 8 full blocks (the last
    # sampled token is never computed).
    assert len(_saved_hashes(outs)) == 8 == len(set(_saved_hashes(outs)))
    assert _saved_hashes(outs) == first.block_hashes[:8]
    # Saves go out in the step after the one that computed the blocks.
    assert not outs[0].kv_connector_metadata.saves
    # A second request with the same prompt hits locally and saves nothing new.
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT))
    assert _saved_hashes(_run_to_end(scheduler)) == []
    assert scheduler.kv_cache_manager.usage == 0


def _stored_elsewhere() -> list[bytes]:
    donor = _scheduler()
    request = make_request(0, max_tokens=1, prompt_token_ids=PROMPT)
    donor.add_request(request)
    _run_to_end(donor)
    return request.block_hashes


def test_a_stored_prefix_is_loaded_then_admitted_as_local_hits() -> None:
    scheduler = _scheduler()
    scheduler.connector.record_stored(_stored_elsewhere())
    request = make_request(0, max_tokens=2, prompt_token_ids=PROMPT, request_id="r")
    scheduler.add_request(request)
    out, _ = _step(scheduler)
    # No compute yet: a load of the 7 full prompt blocks into reserved blocks.
    assert out.total_num_scheduled_tokens == 0 and not out.scheduled_new_reqs
    (load,) = out.kv_connector_metadata.loads
    assert load.req_id == "r" and len(load.block_ids) == 7
    assert load.block_hashes == request.block_hashes[:7]
    assert load.block_ids == scheduler.get_block_ids("r")
    assert scheduler.num_waiting_for_remote_kvs == 1 and scheduler.has_connector_work()
    # Steps go on (polls) until the worker reports the load.
    out, _ = _step(scheduler)
    assert out.kv_connector_metadata.is_empty() and out.total_num_scheduled_tokens == 0
    out, _ = _step(scheduler, loads={"r": 7})
    assert scheduler.num_waiting_for_remote_kvs == 0
    # The next step admits it: the loaded blocks are hits, only 2 tokens computed.
    out, _ = _step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 28 and out.num_scheduled_tokens == {"r": 2}
    assert new.block_ids[:7] == load.block_ids
    assert request.num_cached_tokens == 28
    _run_to_end(scheduler)
    assert scheduler.kv_cache_manager.usage == 0


def test_a_short_load_recomputes_from_the_first_missing_block() -> None:
    scheduler = _scheduler()
    scheduler.connector.record_stored(_stored_elsewhere())
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT, request_id="r"))
    _step(scheduler)
    _step(scheduler, loads={"r": 3})  # blocks 3..6 missing or corrupt
    # The first missing block is forgotten: lookups stop before it now.
    assert scheduler.connector.num_stored_prefix_blocks(_stored_elsewhere()) == 3
    out, _ = _step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens == {"r": 18}
    # Recomputed blocks are saved again, so the store heals.
    assert len(_saved_hashes(_run_to_end(scheduler))) == 4


def test_abort_before_the_load_is_sent_frees_at_once_and_sends_nothing() -> None:
    scheduler = _scheduler()
    scheduler.connector.record_stored(_stored_elsewhere())
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT, request_id="r"))
    scheduler._schedule_waiting(100, {})  # planned, not yet built into a step
    assert scheduler.num_waiting_for_remote_kvs == 1
    assert scheduler.abort_requests("r") == ["r"]
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.usage == 0
    assert scheduler.schedule().kv_connector_metadata.is_empty()


def test_abort_after_the_load_is_sent_tells_the_worker_to_drop_it() -> None:
    scheduler = _scheduler()
    scheduler.connector.record_stored(_stored_elsewhere())
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT, request_id="r"))
    _step(scheduler)
    assert scheduler.abort_requests("r") == ["r"]
    scheduler.check_integrity()
    # Free at once: the next step drops the load before it writes anything.
    assert scheduler.kv_cache_manager.usage == 0 and not scheduler.has_connector_work()
    scheduler.add_request(make_request(40, max_tokens=1, request_id="next"))
    out, _ = _step(scheduler, loads={"r": 7})  # a late report is ignored
    assert out.finished_req_ids == {"r"} and out.num_scheduled_tokens == {"next": 40}


def test_losing_the_worker_requeues_loading_requests_and_frees_their_blocks() -> None:
    scheduler = _scheduler()
    scheduler.connector.record_stored(_stored_elsewhere())
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT, request_id="r"))
    _step(scheduler)
    assert scheduler.release_remote_loads() == ["r"]
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.usage == 0 and scheduler.num_waiting == 1
    # The restarted worker gets the load anew.
    out, _ = _step(scheduler)
    assert [t.req_id for t in out.kv_connector_metadata.loads] == ["r"]


def test_loads_do_not_use_the_token_budget_and_run_beside_decodes() -> None:
    scheduler = _scheduler(max_num_batched_tokens=8, async_scheduling=True)
    scheduler.connector.record_stored(_stored_elsewhere())
    scheduler.add_request(make_request(3, max_tokens=20, request_id="busy"))
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT, request_id="r"))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"busy": 3}
    assert [t.req_id for t in out.kv_connector_metadata.loads] == ["r"]
    scheduler.check_integrity()
