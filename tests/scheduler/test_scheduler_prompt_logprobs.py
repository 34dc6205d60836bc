"""Prompt logprobs through the scheduler: whole prompts computed, chunks gathered, sent once."""

from __future__ import annotations

from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.step import (
    Logprobs,
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
)
from tests.scheduler.factories import make_output, make_request, make_scheduler

BLOCK = 4
PROMPT = list(range(500, 530))  # 30 tokens: 7 full blocks


def _entry(position: int) -> Logprobs:
    return Logprobs(PROMPT[position], -0.1 * position, position, [], [])


def _worker_answer(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """make_output plus what the worker scores: prompt positions this step computes."""
    result = make_output(out, scheduler=scheduler)
    computed_before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for req_id, count in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        start = computed_before[req_id]
        end = min(start + count, request.num_prompt_tokens - 1)
        if request.sampling_params.prompt_logprobs is not None and end > start:
            entries = [_entry(p) for p in range(start + 1, end + 1)]
            result.prompt_logprobs.append(PromptLogprobs(req_id, start + 1, entries))
    return result


def _run(scheduler: Scheduler) -> tuple[list[SchedulerOutput], list]:
    outs, outputs = [], []
    while scheduler.has_unfinished_requests() or scheduler.has_connector_work():
        out = scheduler.schedule()
        outputs += scheduler.update_from_output(out, _worker_answer(scheduler, out))
        scheduler.check_integrity()
        outs.append(out)
    return outs, outputs


def test_chunks_are_gathered_and_leave_with_the_first_token_only() -> None:
    scheduler = make_scheduler(block_size=BLOCK, long_prefill_token_threshold=8)
    request = make_request(0, max_tokens=3, prompt_token_ids=PROMPT, prompt_logprobs=2)
    scheduler.add_request(request)
    outs, outputs = _run(scheduler)
    assert [o.num_scheduled_tokens[request.request_id] for o in outs[:4]] == [8, 8, 8, 6]
    first, *rest = outputs
    assert first.prompt_logprobs == [_entry(p) for p in range(1, len(PROMPT))]
    assert all(o.prompt_logprobs is None for o in rest) and len(rest) == 2
    assert request.prompt_logprobs is None


def test_a_request_asking_for_prompt_logprobs_skips_prefix_cache_hits() -> None:
    scheduler = make_scheduler(block_size=BLOCK)
    scheduler.add_request(make_request(0, max_tokens=1, prompt_token_ids=PROMPT))
    _run(scheduler)
    scored = make_request(0, max_tokens=1, prompt_token_ids=PROMPT, prompt_logprobs=0)
    plain = make_request(0, max_tokens=1, prompt_token_ids=PROMPT)
    scheduler.add_request(scored)
    scheduler.add_request(plain)
    outs, outputs = _run(scheduler)
    new_reqs = {r.req_id: r.num_computed_tokens for r in outs[0].scheduled_new_reqs}
    assert new_reqs == {scored.request_id: 0, plain.request_id: 28}
    assert (scored.num_cached_tokens, plain.num_cached_tokens) == (0, 28)
    by_id = {o.request_id: o for o in outputs}
    assert by_id[scored.request_id].prompt_logprobs == [_entry(p) for p in range(1, 30)]
    assert by_id[plain.request_id].prompt_logprobs is None


def test_a_request_asking_for_prompt_logprobs_skips_kv_connector_loads() -> None:
    donor = make_scheduler(block_size=BLOCK, enable_kv_connector=True)
    stored = make_request(0, max_tokens=1, prompt_token_ids=PROMPT)
    donor.add_request(stored)
    _run(donor)
    scheduler = make_scheduler(block_size=BLOCK, enable_kv_connector=True)
    assert scheduler.connector is not None
    scheduler.connector.record_stored(stored.block_hashes)
    scored = make_request(0, max_tokens=1, prompt_token_ids=PROMPT, prompt_logprobs=1)
    scheduler.add_request(scored)
    outs, outputs = _run(scheduler)
    assert all(not out.kv_connector_metadata.loads for out in outs)
    assert outs[0].num_scheduled_tokens == {scored.request_id: len(PROMPT)}
    assert outputs[0].prompt_logprobs == [_entry(p) for p in range(1, 30)]


def test_preemption_before_the_first_token_recomputes_and_still_sends_every_position() -> None:
    # 12 blocks of 4: two 30-token prompts prefilled in chunks of 8 cannot both finish.
    scheduler = make_scheduler(
        block_size=BLOCK, num_kv_blocks=12, max_model_len=40, long_prefill_token_threshold=8
    )
    scored = make_request(0, max_tokens=2, prompt_token_ids=PROMPT, prompt_logprobs=0)
    other = make_request(30, max_tokens=8)
    scheduler.add_request(other)
    scheduler.add_request(scored)
    _, outputs = _run(scheduler)
    assert scored.num_preemptions > 0
    (first, *_) = [o for o in outputs if o.request_id == scored.request_id]
    assert first.prompt_logprobs == [_entry(p) for p in range(1, 30)]
