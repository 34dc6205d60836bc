"""The scheduler's side of speculative decoding: drafts budgeted, verified results
rolled back, blocks of rejected drafts freed and never cached, back-off."""

from __future__ import annotations

import pytest

from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.runtime.config import SpeculativeConfig
from tests.scheduler.factories import make_request, make_scheduler, make_spec_output

BLOCK = 4
# A prompt whose last 2-gram (5, 6) occurred before, followed by 7 8 9 10 11.
REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6]


def _scheduler(method: str = "ngram", **spec: object):
    spec.setdefault("num_speculative_tokens", 4)
    if method == "ngram":
        spec.setdefault("prompt_lookup_min", 2)
        spec.setdefault("prompt_lookup_max", 3)
    return make_scheduler(
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=64,
        speculative=SpeculativeConfig(method=method, **spec),  # type: ignore[arg-type]
    )


def _prefill(sched, request, first_token: int = 5):
    """Admit ``request`` and compute its prompt (no drafts in a prefill)."""
    sched.add_request(request)
    out = sched.schedule()
    assert not out.scheduled_spec_decode_tokens
    sched.update_from_output(out, make_spec_output(out, {}, first_token, scheduler=sched))
    return request


def _assert_blocks_fit(sched, request) -> None:
    """A running request holds blocks for its computed tokens and none past its
    known tokens (the tail that only rejected drafts needed went back)."""
    held = len(sched.kv_cache_manager.get_blocks(request.request_id))
    assert cdiv(request.num_computed_tokens, BLOCK) <= held <= cdiv(request.num_tokens, BLOCK)
    sched.check_integrity()


def test_drafts_are_scheduled_with_their_slots_and_fully_accepted_ones_all_count() -> None:
    sched = _scheduler()
    request = _prefill(sched, make_request(0, max_tokens=20, prompt_token_ids=REPEATING), 7)
    # Tokens now end "5 6 7", which began the prompt.
    out = sched.schedule()
    drafts = out.scheduled_spec_decode_tokens[request.request_id]
    assert drafts == [8, 9, 10, 11]
    assert out.num_scheduled_tokens[request.request_id] == 1 + len(drafts)
    blocks = sched.kv_cache_manager.get_blocks(request.request_id)
    assert len(blocks) * BLOCK >= request.num_computed_tokens + 1 + len(drafts)
    num_tokens_before = request.num_tokens
    outputs = sched.update_from_output(out, make_spec_output(out, {}, 99, scheduler=sched))
    assert outputs[0].new_token_ids == [*drafts, 99]
    assert request.num_tokens == num_tokens_before + len(drafts) + 1
    assert request.num_computed_tokens == request.num_tokens - 1
    _assert_blocks_fit(sched, request)


@pytest.mark.parametrize("num_accepted", [0, 1, 2])
def test_rejected_drafts_roll_back_and_their_blocks_are_freed_uncached(num_accepted) -> None:
    sched = _scheduler(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1)
    # Output [5] makes the tail "... 13 5": the 1-gram 5 continues 6 7 8 9 10 11.
    request = _prefill(sched, make_request(0, max_tokens=30, prompt_token_ids=REPEATING[:9]))
    out = sched.schedule()
    drafts = out.scheduled_spec_decode_tokens[request.request_id]
    assert drafts == [6, 7, 8, 9, 10, 11]
    computed_before = request.num_computed_tokens
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    outputs = sched.update_from_output(
        out, make_spec_output(out, {request.request_id: num_accepted}, 99, scheduler=sched)
    )
    assert outputs[0].new_token_ids == [*drafts[:num_accepted], 99]
    assert request.num_computed_tokens == computed_before + 1 + num_accepted
    _assert_blocks_fit(sched, request)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before - 3
    # Every cached block's content is the request's real tokens: no rejected draft.
    pool = sched.kv_cache_manager.block_pool
    for index, block in enumerate(sched.kv_cache_manager.get_blocks(request.request_id)):
        if block.block_hash is not None:
            assert block.block_hash == request.block_hashes[index]
            assert (index + 1) * BLOCK <= request.num_computed_tokens
    assert all(pool.cached_block_hash_to_block.values())


def test_the_token_budget_counts_drafts() -> None:
    sched = make_scheduler(
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=64,
        max_num_batched_tokens=3,
        speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1
        ),
    )
    request = _prefill(sched, make_request(0, max_tokens=30, prompt_token_ids=REPEATING[:3]))
    request_b = make_request(0, max_tokens=30, prompt_token_ids=[40, 41])
    out = sched.schedule()
    assert out.num_scheduled_tokens[request.request_id] == 3  # the token + 2 drafts
    assert out.total_num_scheduled_tokens <= 3
    sched.add_request(request_b)
    sched.update_from_output(out, make_spec_output(out, {}, scheduler=sched))
    sched.check_integrity()


def test_drafts_stop_short_of_max_tokens_and_a_stop_token_truncates_the_run() -> None:
    sched = _scheduler(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1)
    request = _prefill(
        sched,
        make_request(0, max_tokens=4, prompt_token_ids=REPEATING[:9], stop_token_ids=[8]),
    )
    out = sched.schedule()
    # 1 output so far, max_tokens 4: at most 3 more tokens, so at most 2 drafts.
    assert out.scheduled_spec_decode_tokens[request.request_id] == [6, 7]
    sched.update_from_output(out, make_spec_output(out, {}, 8, scheduler=sched))
    assert request.output_token_ids == [5, 6, 7, 8]
    assert request.status.finish_reason is FinishReason.STOP
    sched.check_integrity()

    sched = _scheduler(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1)
    request = _prefill(
        sched,
        make_request(0, max_tokens=30, prompt_token_ids=REPEATING[:9], stop_token_ids=[7]),
    )
    out = sched.schedule()
    (output,) = sched.update_from_output(out, make_spec_output(out, {}, scheduler=sched))
    assert output.new_token_ids == [6, 7]  # drafts after the stop token are dropped
    assert output.finish_reason is FinishReason.STOP
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_no_drafts_for_structured_output_or_seeded_sampling_requests() -> None:
    from kvmesh.services.contracts.sampling_params import StructuredOutputSpec

    sched = _scheduler(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1)
    structured = make_request(
        0,
        prompt_token_ids=REPEATING[:9],
        structured_output=StructuredOutputSpec("regex", "[a-z]+"),
    )
    seeded = make_request(0, prompt_token_ids=REPEATING[:9], temperature=1.0, seed=3)
    seeded_greedy = make_request(0, prompt_token_ids=REPEATING[:9], seed=3, temperature=0.0)
    for request in (structured, seeded, seeded_greedy):
        sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, make_spec_output(out, {}, bonus_token=5, scheduler=sched))
    out = sched.schedule()
    assert set(out.scheduled_spec_decode_tokens) == {seeded_greedy.request_id}


def test_speculation_pauses_for_a_large_batch() -> None:
    sched = _scheduler(
        num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=1
    )
    first = _prefill(sched, make_request(0, prompt_token_ids=REPEATING[:9]))
    out = sched.schedule()
    assert first.request_id in out.scheduled_spec_decode_tokens
    sched.update_from_output(out, make_spec_output(out, {}, 5, scheduler=sched))
    sched.add_request(make_request(0, prompt_token_ids=REPEATING[:9]))
    out = sched.schedule()  # the second one joins: two running from now on
    sched.update_from_output(out, make_spec_output(out, {}, 5, scheduler=sched))
    out = sched.schedule()
    assert not out.scheduled_spec_decode_tokens


def test_a_request_whose_drafts_keep_failing_pauses_then_tries_again() -> None:
    sched = _scheduler(
        num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1, min_acceptance_rate=0.25
    )
    request = _prefill(sched, make_request(0, max_tokens=60, prompt_token_ids=[5, 6, 5, 6]))
    drafted_steps = []
    for _ in range(30):
        out = sched.schedule()
        drafted_steps.append(bool(out.scheduled_spec_decode_tokens))
        # Every draft rejected; the sampled token keeps the 5 6 pattern alive.
        token = 6 if request.all_token_ids[-1] == 5 else 5
        sched.update_from_output(
            out, make_spec_output(out, {request.request_id: 0}, token, scheduler=sched)
        )
        _assert_blocks_fit(sched, request)
    # EMA 1.0 -> 0.5 -> 0.25 -> 0.125: three wasted verifications, then 8 steps off,
    # three more, then 16 off.
    assert drafted_steps[:3] == [True, True, True]
    assert drafted_steps[3:11] == [False] * 8
    assert drafted_steps[11:14] == [True, True, True]
    assert not any(drafted_steps[14:30])
    stats = sched.make_stats().spec_decoding
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 12, 0)


def test_stats_count_drafts_and_acceptance_per_position() -> None:
    sched = _scheduler(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=1)
    request = _prefill(sched, make_request(0, max_tokens=30, prompt_token_ids=REPEATING[:9]))
    out = sched.schedule()
    sched.update_from_output(
        out, make_spec_output(out, {request.request_id: 2}, 99, scheduler=sched)
    )
    stats = sched.make_stats().spec_decoding
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 6, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0, 0]
    assert stats.mean_acceptance_length == 3.0
    assert sched.make_stats().spec_decoding.num_drafts == 0  # counters restart


def test_speculation_refuses_async_scheduling() -> None:
    with pytest.raises(ValueError, match="synchronous"):
        make_scheduler(async_scheduling=True, speculative=SpeculativeConfig(method="ngram"))


def test_preemption_and_abort_with_drafts_keep_the_pool_consistent() -> None:
    """A tight pool: drafts only take blocks above the watermark, and when
    requests are preempted or aborted every block comes back."""
    sched = make_scheduler(
        block_size=BLOCK,
        num_kv_blocks=16,
        max_model_len=64,
        watermark=0.2,
        speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1
        ),
    )
    requests = [make_request(0, max_tokens=40, prompt_token_ids=[5, 6, 7, 5]) for _ in range(3)]
    for request in requests:
        sched.add_request(request)
    for step in range(40):
        out = sched.schedule()
        accepted = {r: step % 3 for r in out.scheduled_spec_decode_tokens}
        sched.update_from_output(out, make_spec_output(out, accepted, 6, scheduler=sched))
        sched.check_integrity()
        if step == 20:
            sched.abort_requests(requests[0].request_id)
    sched.abort_requests([r.request_id for r in requests])
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 16
