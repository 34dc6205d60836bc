"""The last layer runs its attention output, O projection and MLP only for the
rows that sample, when nothing reads the other rows' hidden states.

Those rows still write the last layer's K/V (later tokens attend to it), and
the sampled rows' logits are the ones the whole-batch forward computes.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

PROMPTS = {"a": [3, 17, 42, 99, 5, 8, 11, 2, 70, 31], "b": [7, 1, 64, 20, 9]}


@pytest.fixture(scope="module")
def runner(tiny_runner: ModelRunner) -> ModelRunner:
    return tiny_runner


def _spy_output_rows(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """How many rows each forward asked the model for (None: every row)."""
    seen: list[int | None] = []
    forward = runner.model.forward

    def spy(*args: object, output_rows: torch.Tensor | None = None, **kwargs: object):
        seen.append(None if output_rows is None else int(output_rows.shape[0]))
        hidden = forward(*args, output_rows=output_rows, **kwargs)
        expected = args[0].shape[0] if output_rows is None else output_rows.shape[0]
        assert hidden.shape[0] == expected
        return hidden

    monkeypatch.setattr(runner.model, "forward", spy)
    return seen


def _generate(
    runner: ModelRunner, params: SamplingParams, chunk_size: int | None = None
) -> dict[str, tuple[list[int], list[float]]]:
    runner.reset()
    driver = LocalDriver(runner, chunk_size=chunk_size)
    for req_id, prompt in PROMPTS.items():
        driver.add_request(req_id, prompt, params, max_new_tokens=6)
    done = driver.run()
    runner.reset()
    return {
        req_id: (request.output_token_ids, [lp.logprob for lp in request.logprobs])
        for req_id, request in done.items()
    }


def test_prefill_asks_for_the_sampled_rows_only_and_keeps_the_tokens(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = SamplingParams(temperature=0.0, logprobs=0)
    # Prompt logprobs read every prompt row: the whole last layer runs.
    whole = SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=0)
    seen = _spy_output_rows(runner, monkeypatch)
    expected = _generate(runner, whole)
    assert seen and all(rows is None for rows in seen[:1])
    seen.clear()
    actual = _generate(runner, plain)
    # First step: both prompts (15 rows), 2 sampling rows; then decodes only
    # (every row samples, nothing to skip).
    assert seen[0] == 2
    assert all(rows is None for rows in seen[1:])
    for req_id, (tokens, logprobs) in expected.items():
        assert actual[req_id][0] == tokens
        torch.testing.assert_close(
            torch.tensor(actual[req_id][1]), torch.tensor(logprobs), atol=1e-5, rtol=1e-5
        )


def test_chunks_that_sample_nothing_still_fill_the_last_layers_cache(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4-token chunks: the first chunks of a prompt sample no row (the model is
    asked for none) yet the tokens equal a whole-prompt prefill's, so the last
    layer's K/V of those rows was written."""
    params = SamplingParams(temperature=0.0, logprobs=0)
    expected = _generate(runner, params)
    seen = _spy_output_rows(runner, monkeypatch)
    actual = _generate(runner, params, chunk_size=4)
    assert 0 in seen
    for req_id, (tokens, logprobs) in expected.items():
        assert actual[req_id][0] == tokens
        torch.testing.assert_close(
            torch.tensor(actual[req_id][1]), torch.tensor(logprobs), atol=1e-5, rtol=1e-5
        )
