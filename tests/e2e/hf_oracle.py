"""Hugging Face transformers as the correctness oracle: plain greedy decoding in float32."""

from __future__ import annotations

import functools

import torch

from kvmesh.services.runtime.model_prep import default_model_path


@functools.cache
def _model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def tokenizer():
    return _model_and_tokenizer()[1]


# The default model's greedy tokens per prompt, as far as they were computed:
# several modules ask for the same prompts, and a float32 decode step costs
# ~60 ms here (it reads all 540 MB of weights), the largest part of some tests.
_default_model_tokens: dict[tuple[int, ...], list[int]] = {}


def greedy(
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_at_eos: bool = False,
    model: torch.nn.Module | None = None,
) -> list[int]:
    """Argmax decoding with HF's own KV cache; never stops early unless asked.

    ``model``: another float32 model to decode with (a PEFT adapter on the
    default model); the default model when None (its results are remembered:
    a longer run's first tokens are a shorter run's, token for token).
    """
    if model is not None:
        return _greedy(model, prompt_ids, max_new_tokens)
    key = tuple(prompt_ids)
    tokens = _default_model_tokens.get(key, [])
    if len(tokens) < max_new_tokens:
        tokens = _default_model_tokens[key] = _greedy(
            _model_and_tokenizer()[0], prompt_ids, max_new_tokens
        )
    tokens = tokens[:max_new_tokens]
    if stop_at_eos:
        eos = tokenizer().eos_token_id
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
    return list(tokens)


@torch.inference_mode()
def _greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    next_id = int(out.logits[0, -1].argmax())
    for step in range(max_new_tokens):
        tokens.append(next_id)
        if step == max_new_tokens - 1:
            break  # the last token needs no forward pass after it
        out = model(torch.tensor([[next_id]]), cache=past, use_cache=True)
        past = out.past_key_values
        next_id = int(out.logits[0, -1].argmax())
    return tokens


@torch.inference_mode()
def prompt_logprobs(prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float32 log-probabilities: row p - 1 scores prompt token p."""
    model, _ = _model_and_tokenizer()
    logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]
