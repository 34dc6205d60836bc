"""Stop conditions as the client sees them: finish reason, tokens, stop_reason."""

from __future__ import annotations

from kvmesh.services.contracts.finish_reason import FinishReason
from tests.scheduler.factories import make_request, make_scheduler, run_step

EOS = 2


def _generate(request, tokens: list[int], **config) -> list:
    """Feed ``tokens`` one per step; return every RequestOutput of the request."""
    sched = make_scheduler(**config)
    sched.add_request(request)
    outputs = []
    for token in tokens:
        if not sched.has_unfinished_requests():
            break
        _, step_outputs = run_step(sched, tokens={request.request_id: token})
        outputs += step_outputs
    assert sched.kv_cache_manager.usage == 0.0 or sched.has_unfinished_requests()
    return outputs


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_eos_stops_with_stop_and_keeps_the_eos_token() -> None:
    outputs = _generate(make_request(4, max_tokens=10), [5, 6, EOS, 8])
    assert _tokens(outputs) == [5, 6, EOS]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].stop_reason is None
    assert [o.finish_reason for o in outputs[:-1]] == [None, None]


def test_every_eos_id_of_the_model_stops() -> None:
    # Llama 3 style: config.json names one EOS, generation_config.json more.
    for eos in (EOS, 128_009, 128_008):
        request = make_request(4, max_tokens=10, eos_token_ids=(EOS, 128_009, 128_008))
        outputs = _generate(request, [5, eos, 6])
        assert _tokens(outputs) == [5, eos]
        assert outputs[-1].finish_reason is FinishReason.STOP
        assert outputs[-1].stop_reason is None


def test_ignore_eos_ignores_every_eos_id() -> None:
    request = make_request(4, max_tokens=3, eos_token_ids=(EOS, 7), ignore_eos=True)
    outputs = _generate(request, [7, EOS, 7, 7])
    assert _tokens(outputs) == [7, EOS, 7]
    assert outputs[-1].finish_reason is FinishReason.LENGTH


def test_ignore_eos_runs_to_max_tokens() -> None:
    outputs = _generate(make_request(4, max_tokens=4, ignore_eos=True), [EOS] * 6)
    assert _tokens(outputs) == [EOS] * 4
    assert outputs[-1].finish_reason is FinishReason.LENGTH


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    req = make_request(4, max_tokens=10, min_tokens=3, stop_token_ids=(9,))
    outputs = _generate(req, [EOS, 9, EOS, 5])
    assert _tokens(outputs) == [EOS, 9, EOS]
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_stop_token_ids_record_the_stop_reason() -> None:
    req = make_request(4, max_tokens=10, stop_token_ids=(42, 43))
    outputs = _generate(req, [5, 43, 6])
    assert _tokens(outputs) == [5, 43]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].stop_reason == 43
    assert req.stop_reason == 43


def test_max_tokens_stops_with_length() -> None:
    outputs = _generate(make_request(4, max_tokens=3), [5] * 10)
    assert _tokens(outputs) == [5, 5, 5]
    assert outputs[-1].finish_reason is FinishReason.LENGTH


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    outputs = _generate(make_request(4, max_tokens=2), [5, EOS])
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_max_model_len_caps_prompt_plus_output() -> None:
    req = make_request(10, max_tokens=100)
    outputs = _generate(req, [5] * 20, max_model_len=14)
    assert len(_tokens(outputs)) == 4
    assert req.num_tokens == 14
    assert outputs[-1].finish_reason is FinishReason.LENGTH


def test_worker_error_finishes_only_that_request() -> None:
    sched = make_scheduler()
    ok, bad = make_request(4, max_tokens=3), make_request(4, max_tokens=3)
    sched.add_request(ok)
    sched.add_request(bad)
    _, outputs = run_step(sched, errors={bad.request_id: "NaN in logits"})
    by_id = {o.request_id: o for o in outputs}
    assert by_id[bad.request_id].finish_reason is FinishReason.ERROR
    assert by_id[bad.request_id].error == "NaN in logits"
    assert by_id[bad.request_id].new_token_ids == []
    assert by_id[ok.request_id].new_token_ids == [7]
    assert by_id[ok.request_id].finish_reason is None
    out, _ = run_step(sched)
    assert out.finished_req_ids == {bad.request_id}
    assert list(out.num_scheduled_tokens) == [ok.request_id]
    while sched.has_unfinished_requests():
        run_step(sched)
    assert ok.num_output_tokens == 3
    assert sched.kv_cache_manager.usage == 0.0
