"""Tiny random-weight checkpoints of every served family, built from transformers configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Small enough for a 2-core box, big enough for GQA, several heads and layers.
COMMON: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def family_config(architecture: str, **overrides: Any) -> Any:
    """The transformers config of ``architecture``'s tiny checkpoint."""
    import transformers

    common = {**COMMON, **overrides}
    if architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**{"head_dim": 24, **common})  # head_dim != 64 / 4
    if architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(**common)
    if architecture == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**common)
    if architecture == "MistralForCausalLM":
        return transformers.MistralConfig(**{"head_dim": 16, "sliding_window": None, **common})
    if architecture == "Gemma2ForCausalLM":
        return transformers.Gemma2Config(
            **{
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "final_logit_softcapping": 3.0,
                "attn_logit_softcapping": None,
                "sliding_window": 256,
                **common,
            }
        )
    if architecture == "Gemma3ForCausalLM":
        return transformers.Gemma3TextConfig(
            **{
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "sliding_window": 256,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                },
                **common,
            }
        )
    if architecture == "Phi3ForCausalLM":
        return transformers.Phi3Config(**{"sliding_window": None, **common})
    if architecture == "Olmo2ForCausalLM":
        return transformers.Olmo2Config(**common)
    if architecture == "GraniteForCausalLM":
        return transformers.GraniteConfig(
            **{
                "embedding_multiplier": 3.0,
                "residual_multiplier": 0.5,
                "attention_multiplier": 0.3,
                "logits_scaling": 2.0,
                **common,
            }
        )
    if architecture == "Qwen3MoeForCausalLM":
        return transformers.Qwen3MoeConfig(
            **{
                "head_dim": 16,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
                **common,
            }
        )
    if architecture == "MixtralForCausalLM":
        return transformers.MixtralConfig(
            **{"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None, **common}
        )
    if architecture == "SmolLM3ForCausalLM":
        # Four layers, so that the default interval (llama.cpp's fixed 4, which
        # the GGUF tests need) makes the last one a NoPE layer.
        return transformers.SmolLM3Config(
            **{
                "rope_parameters": {"rope_theta": 10_000.0},
                **common,
                "num_hidden_layers": overrides.get("num_hidden_layers", 4),
            }
        )
    raise ValueError(architecture)


def make_family_checkpoint(
    folder: Path,
    architecture: str,
    scale: float = 0.3,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """Save a random checkpoint of ``architecture`` in ``folder``; return transformers'
    float32 model of it (``attn_implementation``: "eager" where only that one
    applies a feature, as Gemma 2's score soft-cap). Every tensor is random
    (norms around 1, or around 0 for Gemma's 1 + w) with ``scale`` chosen so
    greedy tokens vary."""
    import transformers

    config = family_config(architecture, **overrides)
    model_class = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_class(config)
    gemma = architecture.startswith("Gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (scale if param.ndim > 1 else 0.5))
            if "norm" in name and not gemma:
                param.add_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return model_class.from_pretrained(folder, dtype=torch.float32, **extra).eval()
