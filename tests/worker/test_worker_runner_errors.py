"""One bad request fails alone; seeded requests are reproducible through the runner."""

from __future__ import annotations

import pytest

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

PROMPT = [3, 17, 42, 99, 5, 8]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_runner: ModelRunner) -> ModelRunner:
    return tiny_runner


def _run_alone(runner: ModelRunner, params: SamplingParams, num_tokens: int = 8) -> list[int]:
    driver = LocalDriver(runner)
    driver.add_request("alone", PROMPT, params, num_tokens)
    return driver.run()["alone"].output_token_ids


@pytest.mark.parametrize(
    ("bad_params", "message"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-5), "top_k"),
        (SamplingParams(logit_bias=((10_000, 1.0),)), "logit_bias"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_params_fail_only_their_request(
    runner: ModelRunner, bad_params: SamplingParams, message: str
) -> None:
    expected = _run_alone(runner, GREEDY)
    driver = LocalDriver(runner)
    driver.add_request("good", PROMPT, GREEDY, 8)
    driver.add_request("bad", PROMPT, bad_params, 8)
    finished = driver.run()
    assert finished["bad"].error is not None and message in finished["bad"].error
    assert finished["bad"].output_token_ids == []
    assert finished["good"].error is None
    assert finished["good"].output_token_ids == expected


def test_bad_token_blocks_and_unknown_requests_fail_alone(runner: ModelRunner) -> None:
    expected = _run_alone(runner, GREEDY, 1)
    step = SchedulerOutput.make_empty(step_id=7)
    step.scheduled_new_reqs = [
        NewRequestData("good", PROMPT, [], GREEDY, [0, 1], 0),
        NewRequestData("bad-token", [1, 10_000], [], GREEDY, [2], 0),
        NewRequestData("bad-block", PROMPT, [], GREEDY, [3, 999], 0),
        NewRequestData("too-few-blocks", PROMPT, [], GREEDY, [4], 0),
        NewRequestData("past-the-end", PROMPT, [], GREEDY, [5, 6, 7], 0),
    ]
    step.scheduled_cached_reqs.req_ids = ["ghost"]
    step.scheduled_cached_reqs.new_block_ids = [[8]]
    step.scheduled_cached_reqs.num_computed_tokens = [3]
    step.num_scheduled_tokens = {
        "good": len(PROMPT),
        "bad-token": 2,
        "bad-block": len(PROMPT),
        "too-few-blocks": len(PROMPT),
        "past-the-end": len(PROMPT) + 1,
        "ghost": 1,
    }
    step.total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
    output = runner.execute_model(step)
    assert output.step_id == 7
    assert output.req_ids == ["good"]
    assert output.sampled_token_ids == [expected]
    assert set(output.errors) == {
        "bad-token",
        "bad-block",
        "too-few-blocks",
        "past-the-end",
        "ghost",
    }
    # The failed requests hold no state in the worker afterwards.
    assert "too-few-blocks" not in runner.input_batch
    finish = SchedulerOutput.make_empty(step_id=8)
    finish.finished_req_ids = {"good"}
    runner.execute_model(finish)
    assert len(runner.input_batch) == 0


def test_seeded_request_same_tokens_alone_batched_and_after_preemption(
    runner: ModelRunner,
) -> None:
    seeded = SamplingParams(temperature=1.5, seed=2024)
    alone = _run_alone(runner, seeded, 10)
    assert len(set(alone)) > 1

    driver = LocalDriver(runner)
    driver.add_request("other-1", [5, 6, 7], SamplingParams(temperature=1.0), 10)
    driver.add_request("seeded", PROMPT, seeded, 10)
    driver.add_request("other-2", [9] * 9, SamplingParams(temperature=0.8, seed=1), 10)
    assert driver.run()["seeded"].output_token_ids == alone

    # Preempt after 4 tokens: the worker drops the request, then gets it back
    # as a new request carrying its 4 outputs and recomputes from scratch.
    driver = LocalDriver(runner)
    request = driver.add_request("seeded", PROMPT, seeded, 10)
    while len(request.output_token_ids) < 4:
        driver.step()
    driver.free_blocks.extend(request.owned_block_ids)
    request.block_ids, request.owned_block_ids = [], []
    request.num_computed_tokens, request.sent = 0, False
    driver._to_drop.add("seeded")
    assert driver.run()["seeded"].output_token_ids == alone


def test_top_k_past_the_vocabulary_runs_like_top_k_off(runner: ModelRunner) -> None:
    """The step of a huge top_k used to fail for every request in it."""
    huge = SamplingParams(temperature=1.0, top_k=100_000, seed=7)
    off = SamplingParams(temperature=1.0, top_k=0, seed=7)
    expected = _run_alone(runner, off)
    assert _run_alone(runner, huge) == expected
    driver = LocalDriver(runner)
    driver.add_request("greedy", PROMPT, GREEDY, 8)
    driver.add_request("huge", PROMPT, huge, 8)
    driver.add_request("other", [7, 8, 9], SamplingParams(temperature=0.9, top_k=3), 8)
    finished = driver.run()
    assert all(request.error is None for request in finished.values())
    assert finished["huge"].output_token_ids == expected
    assert finished["greedy"].output_token_ids == _run_alone(runner, GREEDY)


def test_a_sampling_failure_fails_only_its_request(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = 0.123
    expected = {
        "greedy": _run_alone(runner, GREEDY),
        "seeded": _run_alone(runner, SamplingParams(temperature=1.0, seed=3)),
    }
    sample = runner.sampler.sample

    def failing_sample(logits, metadata):
        if bool((metadata.temperature == poison).any()):
            raise RuntimeError("selected index k out of range")
        return sample(logits, metadata)

    monkeypatch.setattr(runner.sampler, "sample", failing_sample)
    driver = LocalDriver(runner)
    driver.add_request("greedy", PROMPT, GREEDY, 8)
    driver.add_request("bad", PROMPT, SamplingParams(temperature=poison), 8)
    driver.add_request("seeded", PROMPT, SamplingParams(temperature=1.0, seed=3), 8)
    finished = driver.run()
    assert finished["bad"].error is not None and "out of range" in finished["bad"].error
    assert "bad" not in runner.input_batch
    for name, tokens in expected.items():
        assert finished[name].error is None
        assert finished[name].output_token_ids == tokens
