"""Model classes by the ``architectures`` name in a checkpoint's config.json."""

from __future__ import annotations

from torch import nn

from worker.models.llama import LlamaForCausalLM

# Mistral and Qwen2 share Llama's layout; Qwen2's q/k/v biases are switched on
# by ModelConfig.attention_bias.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    model_class = MODEL_REGISTRY.get(architecture)
    if model_class is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        )
    return model_class  # type: ignore[return-value]
