"""A step in two halves: a later step may begin before an earlier one finishes
(pipeline overlap), and must not disturb the rows the earlier one still uses."""

from __future__ import annotations

import pytest

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData, SchedulerOutput
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
PROMPT_A = [3, 17, 42, 99, 5, 8]
PROMPT_B = [7, 1, 64, 20]


@pytest.fixture(scope="module")
def runner(tiny_runner: ModelRunner) -> ModelRunner:
    return tiny_runner


def _first_token(runner: ModelRunner, prompt: list[int]) -> int:
    driver = LocalDriver(runner)
    driver.add_request("alone", prompt, GREEDY, 1)
    return driver.run()["alone"].output_token_ids[0]


def _prefill(step_id: int, req_id: str, prompt: list[int], blocks: list[int]) -> SchedulerOutput:
    step = SchedulerOutput.make_empty(step_id)
    step.scheduled_new_reqs = [NewRequestData(req_id, prompt, [], GREEDY, blocks, 0)]
    step.num_scheduled_tokens = {req_id: len(prompt)}
    step.total_num_scheduled_tokens = len(prompt)
    return step


def test_a_request_dropped_while_its_step_is_begun_keeps_its_row(runner: ModelRunner) -> None:
    want_a, want_b = _first_token(runner, PROMPT_A), _first_token(runner, PROMPT_B)
    runner.reset()
    first = runner.begin_step(_prefill(0, "a", PROMPT_A, [0, 1]))
    row_a = runner.input_batch.row_of["a"]
    assert runner.busy_with(_prefill(9, "a", PROMPT_A, [0, 1]))
    # The next step drops a (aborted meanwhile) and brings b, which would take
    # a's row if a left at once; a's blocks may be b's too.
    second_step = _prefill(1, "b", PROMPT_B, [0])
    second_step.finished_req_ids = {"a"}
    assert not runner.busy_with(second_step)
    second = runner.begin_step(second_step)
    assert runner.input_batch.row_of["a"] == row_a != runner.input_batch.row_of["b"]
    out_first = runner.finish_step(first)
    assert out_first.req_ids == ["a"] and out_first.sampled_token_ids == [[want_a]]
    assert "a" not in runner.input_batch  # dropped once its step was done with it
    out_second = runner.finish_step(second)
    assert out_second.sampled_token_ids == [[want_b]]
    assert not runner.busy_with(_prefill(9, "b", PROMPT_B, [0]))
    runner.reset()
