"""Model classes by the ``architectures`` name in a checkpoint's config.json.

Adding a family: its file in this folder (a ``DecoderForCausalLM`` subclass
with its declaration and features), its line in MODEL_REGISTRY below, and its parity test
(docs/architecture.md, "Adding a model").
"""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvmesh.worker.models.granite import GraniteForCausalLM
from kvmesh.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from kvmesh.worker.models.olmo2 import Olmo2ForCausalLM
from kvmesh.worker.models.phi3 import Phi3ForCausalLM
from kvmesh.worker.models.qwen3 import Qwen3ForCausalLM
from kvmesh.worker.models.qwen3_moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from kvmesh.worker.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    model_class = MODEL_REGISTRY.get(architecture)
    if model_class is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        )
    return model_class


def gguf_architectures() -> list[str]:
    """The GGUF architectures (``general.architecture``) families read, each
    with the Hugging Face architecture it loads as."""
    layouts = [c.declaration.gguf for c in _gguf_classes()]
    return sorted(f"{g.architecture} ({g.hf_architecture})" for g in layouts if g is not None)


def _gguf_classes() -> list[type[DecoderForCausalLM]]:
    unique = {id(c): c for c in MODEL_REGISTRY.values() if c.declaration.gguf is not None}
    return list(unique.values())


def gguf_model_class(architecture: str, has_experts: bool) -> type[DecoderForCausalLM]:
    """The family reading a GGUF file of ``architecture`` (llama.cpp's name;
    ``has_experts``: its ``<arch>.expert_count`` is set, Mixtral's "llama")."""
    for model_class in _gguf_classes():
        layout = model_class.declaration.gguf
        assert layout is not None
        if layout.architecture == architecture and layout.experts == has_experts:
            return model_class
    kind = " with experts" if has_experts else ""
    raise UnsupportedModelError(
        f"unsupported GGUF architecture {architecture!r}{kind}; supported: {gguf_architectures()}"
    )


def check_model(config: ModelConfig) -> type[DecoderForCausalLM]:
    """The checkpoint's model class, after refusing anything in its config that
    the class does not implement (UnsupportedModelError names the field)."""
    model_class = get_model_class(config.architecture)
    model_class.check_config(config)
    return model_class
