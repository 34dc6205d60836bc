"""The bfloat16 path: greedy tokens agree with transformers run in bfloat16 on the same
weights, and the projections still find their exact block codes before rounding.

bfloat16 is not bit-exact across implementations: transformers rounds each
projection's weights to bf16 and runs them through oneDNN's bf16 kernels;
kvmesh runs small batches on the checkpoint's exact 8-bit block codes in float32
and rounds only their outputs, and sums attention in float32 in another order.
A near-tie between two tokens can therefore flip, after which two free-running
greedy continuations differ entirely (transformers' own bf16 and float32 runs
share 72% of 32-token continuations of the e2e prompts). So agreement is
measured teacher-forced, as the next-token argmax at every position of
transformers' bf16 greedy sequence given the same prefix: the bar issue 13 set
is >= 95% of the tokens; measured on the AVX512-BF16 EPYC: 100% on both of
kvmesh's bf16 paths, where transformers' float32 agrees with its bf16 on 96.9%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.linear import MAX_BLOCK_CODE_ROWS_BF16

from .conftest import hf_greedy_tokens

MAX_NEW_TOKENS = 32
# One top logprob per prompt position: its token is the model's argmax there.
SCORE_PROMPT = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def bf16_runner(model_path: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(model_path, max_model_len=256, dtype="bfloat16"),
        CacheConfig(block_size=16, num_kv_blocks=128),
        num_threads=1,
    )


@pytest.fixture(scope="module")
def hf_bf16_sequences(
    model_path: Path, prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """transformers bf16: each prompt + its greedy continuation, and the argmax
    at every position of that sequence (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    sequences, argmaxes = [], []
    for prompt in prompts:
        sequence = prompt + hf_greedy_tokens(hf, prompt, MAX_NEW_TOKENS, MAX_NEW_TOKENS)
        sequences.append(sequence)
        with torch.inference_mode():
            argmaxes.append(hf(torch.tensor([sequence])).logits[0].argmax(-1).tolist())
    return sequences, argmaxes


@pytest.mark.parametrize("chunk_size", [None, MAX_BLOCK_CODE_ROWS_BF16 // 2])
def test_bf16_next_token_argmax_agrees_with_transformers_bf16(
    bf16_runner: ModelRunner,
    prompts: list[list[int]],
    hf_bf16_sequences: tuple[list[list[int]], list[list[int]]],
    chunk_size: int | None,
) -> None:
    """Whole prompts in one step run oneDNN's bf16 projections; chunks of 6
    rows run the block-code kernels that serve decode steps."""
    sequences, expected = hf_bf16_sequences
    driver = LocalDriver(bf16_runner, chunk_size=chunk_size)
    for index, sequence in enumerate(sequences):
        driver.add_request(f"tf-{index}", sequence, SCORE_PROMPT, 1)
    finished = driver.run()
    same = total = 0
    for index, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        scored = finished[f"tf-{index}"].prompt_logprobs
        # Entry q scores token q; its top token is the argmax after q - 1 tokens.
        for position in range(len(prompt), len(sequence)):
            same += scored[position].top_token_ids[0] == expected[index][position - 1]
            total += 1
    assert total == len(prompts) * MAX_NEW_TOKENS
    assert same / total >= 0.95, f"{same} of {total} next-token argmaxes agree"


def test_bf16_model_rounds_every_weight_after_finding_block_codes(
    bf16_runner: ModelRunner,
) -> None:
    model = bf16_runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with_codes, total = model.block_code_coverage()
    # The default model came from a GGUF file: its projections are exact block
    # codes in float32, found before the weights were rounded to bf16.
    if with_codes == 0:
        pytest.skip("the C++ kernels are unavailable here (no block-code projections)")
    assert with_codes == total
    logits = model.compute_logits(torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
