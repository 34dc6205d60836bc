"""Speculative decoding through the real Scheduler and ModelRunner, in process:
greedy outputs equal decoding without drafts (and transformers), with every
sampling feature that applies per position."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.scheduler.spec_decode.speculator import SpecDecodingStats
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import Logprobs
from kvmesh.services.runtime.config import SpeculativeConfig
from kvmesh.worker.model_runner import ModelRunner

from .conftest import PROMPT_TEXTS, truncate_at_eos

pytestmark = pytest.mark.model

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# The batches here hold 6 requests: above the default disable_by_batch_size,
# which would switch drafting off.
NGRAM = SpeculativeConfig(
    method="ngram",
    num_speculative_tokens=4,
    prompt_lookup_min=1,
    prompt_lookup_max=3,
    disable_by_batch_size=16,
)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4, disable_by_batch_size=16)
# A text the model is asked to copy (it does, with SmolLM2's chat template):
# prompt lookup drafts most of the copy.
REPEAT_TEXT = (
    "<|im_start|>user\nRepeat the following text word for word.\nText: The committee met "
    "on Tuesday to discuss the budget for the new library. After a long debate, they agreed "
    "to fund the project in two phases.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def spec_prompts(model_path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in [*PROMPT_TEXTS, REPEAT_TEXT]]


def _generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    speculative: SpeculativeConfig | None,
) -> tuple[list[list[int]], list[list[Logprobs]], SpecDecodingStats | None]:
    """Run every prompt to completion in one batch; (tokens, logprobs, spec stats) per prompt."""
    runner.reset()
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=256,
            block_size=16,
            num_kv_blocks=runner.num_kv_blocks,
            async_scheduling=False,
            speculative=speculative,
        )
    )
    eos = runner.model_config.eos_token_ids
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{index}", prompt, params, eos, 0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list[Logprobs]] = {f"r{i}": [] for i in range(len(prompts))}
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        for output in scheduler.update_from_output(step, runner.execute_model(step)):
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.new_token_ids)
            logprobs[output.request_id].extend(output.new_logprobs or [])
        scheduler.check_integrity()
    stats = scheduler.make_stats().spec_decoding
    return list(tokens.values()), list(logprobs.values()), stats


@pytest.mark.parametrize("speculative", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_with_drafts_equals_greedy_without(runner, spec_prompts, speculative) -> None:
    plain, _, _ = _generate(runner, spec_prompts, GREEDY, None)
    drafted, _, stats = _generate(runner, spec_prompts, GREEDY, speculative)
    assert drafted == plain
    assert all(len(tokens) == MAX_TOKENS for tokens in drafted)
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_copying_prompt_matches_transformers_and_accepts_most_drafts(
    runner, spec_prompts, hf_model, hf_greedy
) -> None:
    prompt = spec_prompts[-1]
    (tokens,), _, stats = _generate(runner, [prompt], GREEDY, NGRAM)
    eos = runner.model_config.eos_token_ids
    # transformers stops at EOS; the request here ignores it.
    assert truncate_at_eos(tokens, eos) == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert stats is not None and stats.mean_acceptance_length > 1.5


def test_logprobs_and_penalties_apply_at_every_draft_position(runner, spec_prompts) -> None:
    params = replace(GREEDY, logprobs=3, repetition_penalty=1.3, frequency_penalty=0.2)
    plain, plain_logprobs, _ = _generate(runner, spec_prompts, params, None)
    drafted, drafted_logprobs, stats = _generate(runner, spec_prompts, params, NGRAM)
    assert drafted == plain
    assert stats is not None and stats.num_accepted_tokens > 0
    for tokens, expected, got in zip(drafted, plain_logprobs, drafted_logprobs, strict=True):
        assert [lp.token_id for lp in got] == tokens
        assert len(got) == len(expected)
        for a, b in zip(expected, got, strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert b.logprob == pytest.approx(a.logprob, abs=2e-3)
            assert len(b.top_logprobs) == 3


def test_stop_tokens_cut_an_accepted_run(runner, spec_prompts) -> None:
    prompt = spec_prompts[-1]
    (plain,), _, _ = _generate(runner, [prompt], GREEDY, None)
    stop = plain[10]  # reached inside a run of accepted drafts or at its end
    params = replace(GREEDY, stop_token_ids=(stop,))
    (expected,), _, _ = _generate(runner, [prompt], params, None)
    (drafted,), _, _ = _generate(runner, [prompt], params, NGRAM)
    assert drafted == expected
    assert drafted[-1] == stop and stop not in drafted[:-1]


def test_sampled_requests_with_drafts_run_to_their_length(runner, spec_prompts) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=MAX_TOKENS)
    tokens, _, stats = _generate(runner, spec_prompts, replace(params, ignore_eos=True), NGRAM)
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(spec_prompts)
    assert stats is not None and stats.num_drafts > 0
