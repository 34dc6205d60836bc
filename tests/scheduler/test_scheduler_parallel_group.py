"""n > 1 siblings (one parallel_group) compute their shared prompt once."""

from __future__ import annotations

from kvmesh.services.contracts.step import ModelRunnerOutput
from tests.scheduler.factories import make_request, make_scheduler, run_step

PROMPT = list(range(500, 540))  # 40 tokens: 2 full blocks of 16 + 8


def _siblings(n: int, group: str = "cmpl-1", prompt: list[int] = PROMPT, **kw) -> list:
    return [
        make_request(len(prompt), prompt_token_ids=prompt, parallel_group=group, max_tokens=4, **kw)
        for _ in range(n)
    ]


def test_siblings_wait_for_the_first_prompt_then_hit_every_full_block() -> None:
    sched = make_scheduler()
    first, *others = siblings = _siblings(4)
    for request in siblings:
        sched.add_request(request)
    out, _ = run_step(sched)
    # Only the first sibling runs while its prompt is computed.
    assert list(out.num_scheduled_tokens) == [first.request_id]
    out, outputs = run_step(sched)
    assert {new.req_id for new in out.scheduled_new_reqs} == {r.request_id for r in others}
    for new in out.scheduled_new_reqs:
        assert new.num_computed_tokens == 32
        assert out.num_scheduled_tokens[new.req_id] == 40 - 32
    cached = {o.request_id: o.num_cached_tokens for o in outputs}
    assert cached == {first.request_id: 0, **{r.request_id: 32 for r in others}}
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * 40, 3 * 32)
    sched.check_integrity()


def test_chunked_prefill_keeps_siblings_waiting_until_the_whole_prompt_is_computed() -> None:
    sched = make_scheduler(long_prefill_token_threshold=16)
    first, second = _siblings(2)
    sched.add_request(first)
    sched.add_request(second)
    for _ in range(3):  # 40 tokens in chunks of 16
        out, _ = run_step(sched)
        assert second.request_id not in out.num_scheduled_tokens
    out, _ = run_step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == second.request_id and new.num_computed_tokens == 32
    sched.check_integrity()


def test_independent_requests_with_the_same_prompt_are_not_held() -> None:
    sched = make_scheduler()
    a = make_request(40, prompt_token_ids=PROMPT)
    b = make_request(40, prompt_token_ids=PROMPT)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {a.request_id, b.request_id}


def test_an_aborted_first_sibling_hands_the_group_to_the_next() -> None:
    sched = make_scheduler(long_prefill_token_threshold=16)
    first, second, third = _siblings(3)
    for request in (first, second, third):
        sched.add_request(request)
    run_step(sched)
    sched.abort_requests(first.request_id)
    out, _ = run_step(sched)
    # The second sibling now leads; the third waits for it.
    assert list(out.num_scheduled_tokens) == [second.request_id]
    while second.num_computed_tokens < second.num_prompt_tokens:
        run_step(sched)
    out, _ = run_step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == third.request_id and new.num_computed_tokens == 32
    sched.check_integrity()


def test_async_scheduling_holds_siblings_until_the_leaders_output_returns() -> None:
    """With a step in flight, the leader's num_computed_tokens covers the prompt before
    its blocks are cached; siblings must still wait for the output, then hit the cache."""
    sched = make_scheduler(async_scheduling=True)
    first, *others = siblings = _siblings(3)
    for request in siblings:
        sched.add_request(request)
    step1 = sched.schedule()
    assert list(step1.num_scheduled_tokens) == [first.request_id]
    step2 = sched.schedule()  # scheduled before step 1's output is known
    assert list(step2.num_scheduled_tokens) == [first.request_id]
    # The worker's answers: the prompt step and the decode step each sample one token.
    for step, token in ((step1, 7), (step2, 8)):
        output = ModelRunnerOutput(step.step_id, [first.request_id], [[token]])
        sched.update_from_output(step, output)
    step3 = sched.schedule()
    admitted = {new.req_id: new.num_computed_tokens for new in step3.scheduled_new_reqs}
    assert admitted == {r.request_id: 32 for r in others}
    sched.check_integrity()
