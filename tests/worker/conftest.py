"""Shared fixtures for worker tests: the default model, its tokenizer, HF oracles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.model_prep import default_model_path

# Text of different lengths (the tokenized prompts range from a few tokens to ~60).
PROMPT_TEXTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. His hands were slow but precise, and "
    "people travelled for days to bring him their broken watches. One winter morning, a stranger",
    "List three facts about the moon. 1.",
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = default_model_path()
    if not (path / "config.json").is_file():
        pytest.skip(f"default model not prepared at {path}")
    return path


@pytest.fixture(scope="session")
def prompts(model_path: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def hf_model(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy_tokens(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (stops early at EOS, like a user would see)."""
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_p=None,
            top_k=None,
            temperature=None,
        )
    return output[0, len(prompt) :].tolist()


def truncate_at_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: index + 1]
    return tokens


@pytest.fixture(scope="session")
def hf_greedy():
    return hf_greedy_tokens
