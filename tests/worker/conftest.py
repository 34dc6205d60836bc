"""Shared fixtures for worker tests: the default model, its tokenizer, HF oracles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner

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


def hf_greedy_tokens(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, min_new_tokens: int = 0
) -> list[int]:
    """transformers' greedy continuation (stops early at EOS, like a user would
    see, unless ``min_new_tokens`` says otherwise)."""
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
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


@pytest.fixture(scope="module")
def runner(model_path: Path) -> ModelRunner:
    """The default model in a small cache (a module may define its own ``runner``)."""
    return ModelRunner(
        ModelConfig.from_pretrained(model_path, max_model_len=256),
        CacheConfig(block_size=16, num_kv_blocks=128),
        # One intra-op thread: on a 2-core CI box shared with other jobs, two
        # OpenMP threads spin-wait on each other and run several times slower.
        num_threads=1,
    )


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """A random tiny Llama in a small cache with 4-token blocks, one per module."""
    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_checkpoint(folder, "LlamaForCausalLM", torch.float32)
    return ModelRunner(
        ModelConfig.from_pretrained(folder),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )


def make_tiny_checkpoint(
    folder: Path,
    architecture: str,
    dtype: torch.dtype,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    **shape: int,
) -> torch.nn.Module:
    """A small random checkpoint; ``shape`` overrides config fields (heads, layers...)."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(shape)
    if architecture == "Qwen2ForCausalLM":
        config = transformers.Qwen2Config(**common)
        model_class = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    # Default init leaves norms at 1 and biases at 0 and makes near-uniform
    # logits; randomize every tensor so each weight (and greedy) matters.
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if param.ndim > 1 else 0.5))
            if "norm" in name:
                param.add_(1.0)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model_class.from_pretrained(folder, dtype=torch.float32).eval()
