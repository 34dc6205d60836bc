"""Micro-batches for pipeline parallelism: P steps in flight, each with its own requests.

The simulated worker of the async tests checks the KV of every position a step
reads, so a block freed and reused under a step still in flight fails here;
``drive`` asserts that no request is in two unanswered steps.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.scheduler.request import Request
from kvmesh.scheduler.request_status import RequestStatus
from tests.scheduler.factories import make_scheduler, random_workload
from tests.scheduler.test_scheduler_async import BLOCK_SIZE, SimulatedWorker, _request, drive


def _decoding(sched, worker: SimulatedWorker, n: int, max_tokens: int = 20) -> list[Request]:
    """``n`` requests past their prefill (one step, answered)."""
    requests = [_request(f"d{i}", 3, max_tokens, ignore_eos=True) for i in range(n)]
    for request in requests:
        sched.add_request(request)
    prefill = sched.schedule()
    assert len(prefill.num_scheduled_tokens) == n
    sched.update_from_output(prefill, worker.execute(prefill))
    return requests


def test_config_keeps_one_step_per_micro_batch_in_flight() -> None:
    assert make_scheduler(async_scheduling=True).config.steps_in_flight == 2
    assert make_scheduler(async_scheduling=False).config.steps_in_flight == 1
    pp4 = make_scheduler(async_scheduling=True, num_micro_batches=4)
    assert pp4.config.steps_in_flight == 4
    with pytest.raises(ValueError, match="async scheduling"):
        make_scheduler(num_micro_batches=2)


@pytest.mark.parametrize("num_micro_batches", [2, 3])
def test_p_steps_in_flight_split_the_running_batch_disjointly(num_micro_batches: int) -> None:
    sched = make_scheduler(
        block_size=BLOCK_SIZE, async_scheduling=True, num_micro_batches=num_micro_batches
    )
    worker = SimulatedWorker()
    requests = _decoding(sched, worker, 6)
    steps = [sched.schedule() for _ in range(num_micro_batches)]
    batches = [set(step.num_scheduled_tokens) for step in steps]
    # Every running request in exactly one in-flight step, the steps of equal size.
    assert set().union(*batches) == {r.request_id for r in requests}
    assert sum(len(b) for b in batches) == len(requests)
    assert {len(b) for b in batches} == {6 // num_micro_batches}
    # With every request in flight, a further step has nothing to run.
    assert not sched.schedule().num_scheduled_tokens
    # The oldest step answered: its requests (and only those) run again.
    sched.update_from_output(steps[0], worker.execute(steps[0]))
    for step in steps[1:]:
        worker.execute(step)
    again = sched.schedule()
    assert set(again.num_scheduled_tokens) == batches[0]
    sched.check_integrity()


def test_results_must_arrive_in_step_order() -> None:
    sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=True, num_micro_batches=2)
    worker = SimulatedWorker()
    _decoding(sched, worker, 4)
    first, second = sched.schedule(), sched.schedule()
    first_result, second_result = worker.execute(first), worker.execute(second)
    with pytest.raises(ValueError, match="expected step"):
        sched.update_from_output(first, second_result)
    outputs = sched.update_from_output(first, first_result)
    assert {o.request_id for o in outputs} == set(first.num_scheduled_tokens)
    outputs = sched.update_from_output(second, second_result)
    assert {o.request_id for o in outputs} == set(second.num_scheduled_tokens)


def test_abort_of_a_request_in_flight_drops_its_answer_and_tells_the_worker() -> None:
    sched = make_scheduler(block_size=BLOCK_SIZE, async_scheduling=True, num_micro_batches=2)
    worker = SimulatedWorker()
    _decoding(sched, worker, 4)
    first = sched.schedule()
    victim = next(iter(first.num_scheduled_tokens))
    assert sched.abort_requests(victim) == [victim]
    sched.check_integrity()
    second = sched.schedule()
    assert victim in second.finished_req_ids
    assert victim not in second.num_scheduled_tokens
    outputs = sched.update_from_output(first, worker.execute(first))
    assert victim not in {o.request_id for o in outputs}
    sched.update_from_output(second, worker.execute(second))
    sched.check_integrity()


def test_request_preempted_in_flight_waits_for_its_step_before_readmission() -> None:
    # Two requests fill the pool; a's next block can only come from b, which is
    # in the other unanswered step.
    sched = make_scheduler(
        num_kv_blocks=4, block_size=BLOCK_SIZE, max_model_len=16, watermark=0.0,
        async_scheduling=True, num_micro_batches=2,
    )  # fmt: skip
    worker = SimulatedWorker()
    a, b = (_request(name, 7, 8, ignore_eos=True) for name in ("a", "b"))
    sched.add_request(a)
    sched.add_request(b)
    prefill = sched.schedule()
    sched.update_from_output(prefill, worker.execute(prefill))
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert (set(s1.num_scheduled_tokens), set(s2.num_scheduled_tokens)) == ({"a"}, {"b"})
    r1, r2 = worker.execute(s1), worker.execute(s2)
    sched.update_from_output(s1, r1)
    s3 = sched.schedule()  # a crosses into a third block: b (in flight in s2) is the victim
    assert b.status is RequestStatus.PREEMPTED
    assert set(s3.num_scheduled_tokens) == {"a"} and s3.finished_req_ids == {"b"}
    r3 = worker.execute(s3)
    sched.abort_requests("a")  # the pool is free now, but b's step is still unanswered
    s4 = sched.schedule()
    assert not s4.scheduled_new_reqs, "b admitted again while its old step is in flight"
    r4 = worker.execute(s4)
    sched.check_integrity()
    assert sched.update_from_output(s2, r2) == []  # b's stale token is dropped
    assert sched.update_from_output(s3, r3) == []  # a was aborted
    sched.update_from_output(s4, r4)
    s5 = sched.schedule()
    assert [new.req_id for new in s5.scheduled_new_reqs] == ["b"]
    assert s5.scheduled_new_reqs[0].output_token_ids == b.output_token_ids
    sched.update_from_output(s5, worker.execute(s5))
    sched.check_integrity()


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("num_micro_batches", [2, 3])
def test_random_workloads_give_the_synchronous_tokens(seed: int, num_micro_batches: int) -> None:
    """Budgets, preemption (small pools), prefix hits and aborts with P steps in flight."""
    rng = random.Random(1000 + seed)
    specs, config = random_workload(rng, BLOCK_SIZE)
    aborted_ids = {spec[0] for spec in specs if rng.random() < 0.2}
    abort_at = {req_id: rng.randint(1, 10) for req_id in aborted_ids}
    runs = {}
    for micro in (0, num_micro_batches):
        sched = (
            make_scheduler(**config)
            if micro == 0
            else make_scheduler(async_scheduling=True, num_micro_batches=micro, **config)
        )
        arrivals: dict[int, list[Request]] = {}
        aborts: dict[int, list[str]] = {}
        for req_id, prompt, max_tokens, ignore_eos, arrival in specs:
            request = _request(
                req_id, len(prompt), max_tokens, prompt_token_ids=prompt, ignore_eos=ignore_eos
            )
            arrivals.setdefault(arrival, []).append(request)
            if req_id in abort_at:
                aborts.setdefault(arrival + abort_at[req_id], []).append(req_id)
        # drive() checks the KV of every position read, disjointness and integrity.
        runs[micro] = drive(sched, SimulatedWorker(), arrivals, aborts)
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == config["num_kv_blocks"]
    sync, micro_batched = runs[0], runs[num_micro_batches]
    # Requests finished before their abort came in both runs keep every token; a
    # request aborted in either run may stop at a different point in each.
    unaffected = set(sync.finish) - sync.aborted - micro_batched.aborted
    for req_id in unaffected:
        assert micro_batched.tokens.get(req_id) == sync.tokens.get(req_id), req_id
        assert micro_batched.finish[req_id] == sync.finish[req_id]
    assert set(micro_batched.finish) | micro_batched.aborted == {spec[0] for spec in specs}
