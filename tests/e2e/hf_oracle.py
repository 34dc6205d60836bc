"""Hugging Face transformers as the correctness oracle: plain greedy decoding in float32."""

from __future__ import annotations

import functools

import torch

from services.model_prep import default_model_path


@functools.cache
def _model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def tokenizer():
    return _model_and_tokenizer()[1]


@torch.inference_mode()
def greedy(
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_at_eos: bool = False,
    model: torch.nn.Module | None = None,
) -> list[int]:
    """Argmax decoding with HF's own KV cache; never stops early unless asked.

    ``model``: another float32 model to decode with (a PEFT adapter on the
    default model); the default model when None.
    """
    default_model, tok = _model_and_tokenizer()
    model = default_model if model is None else model
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    next_id = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        tokens.append(next_id)
        if stop_at_eos and next_id == tok.eos_token_id:
            break
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
