"""Measuring what quantized weights cost in accuracy: greedy agreement and perplexity.

The measures of ``benchmarks/quant_accuracy.py`` (which prints them for five
ways to hold the default model's weights), shared with the quantization tests
that hold them to a floor (tests/worker/test_worker_quantized*.py,
test_worker_w8a8.py):

* agreement: tokens before each prompt's first divergence, over all tokens
  (after a divergence the continuations are different texts; comparing them
  position by position would mean nothing);
* perplexity of ``FIXED_TEXT`` (every token's log-probability as a prompt).
"""

from __future__ import annotations

import math
from pathlib import Path

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

FIXED_TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and "
    "spread to continental Europe and North America during the nineteenth. Mechanized "
    "spinning and weaving transformed the textile industry, while improvements to the steam "
    "engine by James Watt made it practical to power factories, mines and, later, railways. "
    "Cities grew quickly as workers moved from the countryside in search of wages, and the "
    "new factory system changed how people lived, worked and thought about time."
)


def make_runner(path: str | Path, quantization: str | None = None) -> ModelRunner:
    """A float32 runner with a small cache, one thread (a shared 2-core box)."""
    return ModelRunner(
        ModelConfig.from_pretrained(path, max_model_len=512, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=96),
        num_threads=1,
    )


def greedy_tokens(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (EOS ignored), all in one batch."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        driver.add_request(str(index), prompt, params, max_tokens)
    finished = driver.run()
    return [finished[str(index)].output_token_ids for index in range(len(prompts))]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    """Tokens before each sequence's first divergence from ``reference``, over all tokens."""
    agreed = total = 0
    for want, got in zip(reference, tokens, strict=True):
        total += len(want)
        for a, b in zip(want, got, strict=False):
            if a != b:
                break
            agreed += 1
    return agreed / total


def perplexity(runner: ModelRunner, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1..n given their prefixes."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    driver.add_request("ppl", token_ids, params, 1)
    scored = driver.run()["ppl"].prompt_logprobs
    logprobs = [scored[position].logprob for position in range(1, len(token_ids))]
    return math.exp(-sum(logprobs) / len(logprobs))
