"""Prompt logprobs from the ModelRunner equal transformers' log_softmax of its logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import Logprobs
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.prompt_logprobs import PromptLogprobsSpan, compute_prompt_logprobs

pytestmark = pytest.mark.model

NUM_TOP = 3
PARAMS = SamplingParams(temperature=0.0, prompt_logprobs=NUM_TOP)


def _hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p - 1 is the distribution of prompt token p."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _assert_matches_hf(got: dict[int, Logprobs], hf: torch.Tensor, prompt: list[int]) -> None:
    assert sorted(got) == list(range(1, len(prompt)))
    for position, entry in got.items():
        row = hf[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        top = row.topk(NUM_TOP)
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_token_ids == top.indices.tolist()


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_prompt_logprobs_match_hf_whole_and_chunked(
    runner: ModelRunner, hf_model, prompts: list[list[int]], chunk_size: int | None
) -> None:
    driver = LocalDriver(runner, chunk_size=chunk_size)
    for index, prompt in enumerate(prompts):
        driver.add_request(f"p{index}", prompt, PARAMS, max_new_tokens=2)
    # A neighbour without prompt logprobs shares every step and gets none.
    driver.add_request("plain", prompts[0], SamplingParams(temperature=0.0), max_new_tokens=2)
    finished = driver.run()
    for index, prompt in enumerate(prompts):
        request = finished[f"p{index}"]
        assert request.error is None, request.error
        _assert_matches_hf(request.prompt_logprobs, _hf_prompt_logprobs(hf_model, prompt), prompt)
    assert finished["plain"].prompt_logprobs == {}


def test_a_request_resumed_after_its_first_token_gets_no_prompt_logprobs_again(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    driver = LocalDriver(runner)
    prompt = prompts[0]
    resumed = driver.add_request("resumed", prompt, PARAMS, max_new_tokens=3)
    # As the scheduler resends a preempted request: prompt + what it generated.
    resumed.output_token_ids = [prompt[1], prompt[2]]
    driver.run()
    assert resumed.prompt_logprobs == {}


def test_slicing_the_rows_does_not_change_the_results() -> None:
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden = torch.randn(20, 8)
    spans = [
        PromptLogprobsSpan("a", 1, 0, np.array([3, 7, 9, 1, 0]), 2),
        PromptLogprobsSpan("b", 12, 9, np.array(list(range(11))), 0),
    ]

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        return rows @ weight.T

    whole = compute_prompt_logprobs(compute_logits, hidden, spans, max_rows_per_slice=64)
    sliced = compute_prompt_logprobs(compute_logits, hidden, spans, max_rows_per_slice=3)
    assert [r.start_position for r in whole] == [1, 12]
    assert [len(r.entries) for r in whole] == [5, 11]
    assert [e.top_token_ids for e in whole[1].entries] == [[]] * 11
    for a, b in zip(whole, sliced, strict=True):
        assert a.req_id == b.req_id
        for x, y in zip(a.entries, b.entries, strict=True):
            assert (x.token_id, x.rank, x.top_token_ids) == (y.token_id, y.rank, y.top_token_ids)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-6)
    expected = torch.log_softmax(hidden[9] @ weight.T, dim=-1)[0]
    assert whole[1].entries[0].logprob == pytest.approx(float(expected), abs=1e-6)
