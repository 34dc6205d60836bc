"""Qwen3: Llama's layout with an RMSNorm over each q and k head before the
rotation, and an explicit ``head_dim`` (not hidden_size / heads)."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import qwen_layer_windows, refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    LayerKVSpec,
    ModelDeclaration,
    Split,
    vector,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import (
    GGUF_NORM_NAMES,
    GGUF_SPLIT_NAMES,
    NORM_TENSORS,
    NORMS,
    PROJECTIONS,
    SPLIT_LORA,
    SPLIT_TENSORS,
)

# llama.cpp's names of the per-head q/k norms.
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3ForCausalLM(DecoderForCausalLM):
    declaration = ModelDeclaration(
        params={
            **NORMS,
            **PROJECTIONS,
            "q_norm": vector(("head", Split.HEAD_DIM)),
            "k_norm": vector(("head", Split.HEAD_DIM)),
        },
        layer_tensors={
            **NORM_TENSORS,
            **SPLIT_TENSORS,
            "self_attn.q_norm.weight": CheckpointTensor("q_norm", ("head",)),
            "self_attn.k_norm.weight": CheckpointTensor("k_norm", ("head",)),
        },
        lora_targets=SPLIT_LORA,
        gguf=GGUFLayout(
            architecture="qwen3",
            hf_architecture="Qwen3ForCausalLM",
            model_type="qwen3",
            layer_names={**GGUF_NORM_NAMES, **GGUF_QK_NORM_NAMES, **GGUF_SPLIT_NAMES},
        ),
    )

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        return Features(qk_norm="head")

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> list[LayerKVSpec]:
        windows = qwen_layer_windows(config.hf_config, config.num_layers)
        return [LayerKVSpec(config.num_kv_heads, config.head_dim, w) for w in windows]

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        if config.hf_config.get("attention_bias"):
            raise refuse("attention_bias", True, "false")
