"""Preemption by recompute: victim choice, worker notification, resume, same result."""

from __future__ import annotations

from kvmesh.scheduler.request_status import RequestStatus
from tests.scheduler.factories import make_request, make_scheduler, run_step


def _tiny(policy: str):
    # 5 blocks of 4 tokens: two 8-token prompts fit, their decodes do not.
    return make_scheduler(
        num_kv_blocks=5, block_size=4, max_model_len=20, watermark=0.0, policy=policy
    )


def _prompt(start: int) -> list[int]:
    return list(range(start, start + 8))


def test_fcfs_preempts_the_latest_admitted_and_resumes_it_from_the_prefix_cache() -> None:
    sched = _tiny("fcfs")
    a = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(1000))
    b = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(2000))
    sched.add_request(a)
    sched.add_request(b)
    A, B = a.request_id, b.request_id
    trace = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        trace.append(
            (
                out.num_scheduled_tokens,
                [n.req_id for n in out.scheduled_new_reqs],
                out.finished_req_ids,
            )
        )
        sched.check_integrity()
    assert trace == [
        ({A: 8, B: 8}, [A, B], set()),
        ({A: 1}, [], {B}),  # b cannot grow: it is the victim, dropped this step
        ({A: 1}, [], set()),  # b waits: its 2 cached blocks + 1 new > 2 free
        ({A: 1}, [], set()),  # a reaches max_tokens
        ({B: 1}, [B], {A}),  # b resumes with 8 tokens from the cache
        ({B: 1}, [], set()),
        ({B: 1}, [], set()),
    ]
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert a.num_tokens == b.num_tokens == 12
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    stats = sched.make_stats()
    assert stats.num_preemptions == 1
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 8 + 9, 8)


def test_resumed_request_carries_its_output_tokens_to_the_worker() -> None:
    sched = _tiny("fcfs")
    a = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(1000))
    b = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(2000))
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        run_step(sched, tokens={b.request_id: 55})
    out, _ = run_step(sched)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == b.request_id
    assert resumed.prompt_token_ids == _prompt(2000)
    assert resumed.output_token_ids == [55]
    assert resumed.num_computed_tokens == 8
    assert len(resumed.block_ids) == 3
    assert b.num_cached_tokens == 0  # reported to the client: hits at first scheduling


def test_priority_preempts_the_lowest_priority_even_if_admitted_first() -> None:
    sched = _tiny("priority")
    low = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(1000), priority=1)
    sched.add_request(low)
    L = low.request_id
    out, _ = run_step(sched)
    high = make_request(
        8,
        max_tokens=4,
        ignore_eos=True,
        prompt_token_ids=_prompt(2000),
        priority=0,
        arrival_time=1.0,
    )
    sched.add_request(high)
    H = high.request_id
    trace = [(out.num_scheduled_tokens, out.finished_req_ids)]
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        trace.append((out.num_scheduled_tokens, out.finished_req_ids))
        sched.check_integrity()
    assert trace == [
        ({L: 8}, set()),
        ({L: 1, H: 8}, set()),
        # high needs a block: low is the victim although it was scheduled first
        # in this step; its tokens go back to the budget and the worker drops it.
        ({H: 1}, {L}),
        ({H: 1}, set()),
        ({H: 1}, set()),  # high finishes (4 outputs)
        ({L: 2}, {H}),  # low resumes: 8 cached, 2 to recompute -> 3rd output
        ({L: 1}, set()),  # 4th output
    ]
    assert low.num_tokens == high.num_tokens == 12
    assert low.num_preemptions == 1


def test_fcfs_victim_is_the_request_itself_when_it_is_last() -> None:
    sched = _tiny("fcfs")
    low = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(1000))
    sched.add_request(low)
    run_step(sched)
    high = make_request(8, max_tokens=4, ignore_eos=True, prompt_token_ids=_prompt(2000))
    sched.add_request(high)
    run_step(sched)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {low.request_id: 1}
    assert out.finished_req_ids == {high.request_id}
    assert high.status == RequestStatus.PREEMPTED and high.num_computed_tokens == 0
