"""Greedy tokens from the ModelRunner equal transformers' greedy tokens (float32)."""

from __future__ import annotations

import pytest

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

from .conftest import truncate_at_eos

MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def expected(hf_model, hf_greedy, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]


def _outputs(driver: LocalDriver, runner: ModelRunner, ids: list[str]) -> list[list[int]]:
    finished = driver.run()
    eos = runner.model_config.eos_token_ids
    for req_id in ids:
        assert finished[req_id].error is None, finished[req_id].error
    return [truncate_at_eos(finished[req_id].output_token_ids, eos) for req_id in ids]


def test_greedy_one_request_at_a_time(runner, prompts, expected) -> None:
    for index, prompt in enumerate(prompts):
        driver = LocalDriver(runner)
        driver.add_request(f"solo-{index}", prompt, GREEDY, MAX_NEW_TOKENS)
        assert _outputs(driver, runner, [f"solo-{index}"]) == [expected[index]]
    assert min(len(tokens) for tokens in expected) == MAX_NEW_TOKENS


def test_greedy_all_requests_in_one_batch(runner, prompts, expected) -> None:
    driver = LocalDriver(runner)
    ids = [f"batch-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        driver.add_request(req_id, prompt, GREEDY, MAX_NEW_TOKENS)
    assert _outputs(driver, runner, ids) == expected


def test_greedy_with_chunked_prefill(runner, prompts, expected) -> None:
    # Chunks of 7 tokens: prompts straddle block boundaries mid-chunk, and
    # requests in prefill share steps with requests already decoding.
    driver = LocalDriver(runner, chunk_size=7)
    ids = [f"chunked-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        driver.add_request(req_id, prompt, GREEDY, MAX_NEW_TOKENS)
    first_step = driver.step()
    assert min(len(p) for p in prompts) > 7
    assert first_step.sampled_token_ids == [[] for _ in ids]  # nobody finished its prompt
    assert _outputs(driver, runner, ids) == expected


def test_greedy_with_reused_prefix_blocks(runner, prompts, expected) -> None:
    # The longest prompt spans several full blocks; a second request with the
    # same prompt reuses those blocks (num_computed_tokens > 0) and computes the rest.
    index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    prompt = prompts[index]
    block_size = runner.cache_config.block_size
    driver = LocalDriver(runner, free_on_finish=False)
    owner = driver.add_request("prefix-owner", prompt, GREEDY, MAX_NEW_TOKENS)
    driver.run()
    num_full_blocks = (len(prompt) - 1) // block_size
    assert num_full_blocks >= 2
    reused = owner.block_ids[:num_full_blocks]
    driver.add_request(
        "prefix-reuser",
        prompt,
        GREEDY,
        MAX_NEW_TOKENS,
        prefix_block_ids=reused,
        num_computed_tokens=num_full_blocks * block_size,
    )
    step = driver.build_step()
    assert step.num_scheduled_tokens == {"prefix-reuser": len(prompt) - len(reused) * block_size}
    assert step.scheduled_new_reqs[0].block_ids[:num_full_blocks] == reused
    first = runner.execute_model(step)
    driver.apply_output(step, first)
    assert first.sampled_token_ids == [[expected[index][0]]]
    result = _outputs(driver, runner, ["prefix-reuser"])
    assert result == [expected[index]]


def test_default_checkpoint_runs_small_batches_on_exact_block_codes(runner) -> None:
    """SmolLM2's GGUF weights are Q4_1/Q8_0 images: every projection gets codes.

    The greedy tests above then cover the block-code kernel (decode steps of a
    few rows) and oneDNN (prefill steps) against transformers.
    """
    with_codes, total = runner.model.block_code_coverage()
    assert total == runner.model_config.num_layers * 4 + 1
    assert with_codes == total
