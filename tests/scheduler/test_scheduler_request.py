"""Request.append_output_token_ids, the per-token path, and the status enum."""

from __future__ import annotations

from kvmesh.scheduler.request import Request
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.services.contracts.finish_reason import FinishReason
from tests.scheduler.factories import make_output, make_request, make_scheduler

EOS = 2


def _running(n_prompt: int = 4, **params) -> Request:
    request = make_request(n_prompt, **params)
    request.status = RequestStatus.RUNNING
    return request


def test_tokens_that_stop_nothing_are_all_appended() -> None:
    request = _running(max_tokens=10)
    assert request.append_output_token_ids([5, 6, 7], max_model_len=100) == 3
    assert request.output_token_ids == [5, 6, 7]
    assert request.all_token_ids == [*request.prompt_token_ids, 5, 6, 7]
    assert request.status is RequestStatus.RUNNING


def test_eos_stops_and_drops_the_tokens_after_it() -> None:
    request = _running(max_tokens=10)
    assert request.append_output_token_ids([5, EOS, 7], max_model_len=100) == 2
    assert request.output_token_ids == [5, EOS]
    assert request.num_tokens == 4 + 2
    assert request.status.finish_reason is FinishReason.STOP


def test_length_stops_at_max_tokens_and_at_max_model_len() -> None:
    capped = _running(max_tokens=2)
    assert capped.append_output_token_ids([5, 6, 7], max_model_len=100) == 2
    assert capped.status.finish_reason is FinishReason.LENGTH
    full = _running(max_tokens=10)
    assert full.append_output_token_ids([5, 6, 7], max_model_len=5) == 1
    assert full.output_token_ids == [5]
    assert full.status.finish_reason is FinishReason.LENGTH


def test_a_stop_token_sets_the_stop_reason() -> None:
    request = _running(max_tokens=10, stop_token_ids=(42,))
    assert request.append_output_token_ids([42, 5], max_model_len=100) == 1
    assert (request.status.finish_reason, request.stop_reason) == (FinishReason.STOP, 42)


def test_a_step_sampling_past_eos_reports_only_the_tokens_up_to_it() -> None:
    sched = make_scheduler()
    request = make_request(4, max_tokens=10)
    sched.add_request(request)
    out = sched.schedule()
    worker_output = make_output(out, scheduler=sched)
    worker_output.sampled_token_ids = [[5, EOS, 9]]
    (output,) = sched.update_from_output(out, worker_output)
    assert output.new_token_ids == [5, EOS]
    assert output.finish_reason is FinishReason.STOP
    assert worker_output.sampled_token_ids == [[5, EOS, 9]]  # the worker's lists stay as sent
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_only_finished_statuses_have_a_finish_reason() -> None:
    reasons = {status: status.finish_reason for status in RequestStatus}
    assert reasons == {
        RequestStatus.WAITING: None,
        RequestStatus.WAITING_FOR_REMOTE_KVS: None,
        RequestStatus.RUNNING: None,
        RequestStatus.PREEMPTED: None,
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    }
    assert [s for s in RequestStatus if s.is_finished()] == [
        s for s, reason in reasons.items() if reason is not None
    ]
