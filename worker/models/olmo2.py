"""OLMo 2: norms after each sublayer (none before), and q/k RMSNorms over the
whole q and k projections (all heads at once: under TP one small all-reduce
of the sums of squares, worker/models/decoder.py)."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    ModelDeclaration,
    Split,
    vector,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import GGUF_SPLIT_NAMES, PROJECTIONS, SPLIT_LORA, SPLIT_TENSORS
from kvmesh.worker.models.qwen3 import GGUF_QK_NORM_NAMES

# The converter's Olmo2Model: plain names (its q/k norms span every head), rows kept.
OLMO2_GGUF = GGUFLayout(
    architecture="olmo2",
    hf_architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        **GGUF_QK_NORM_NAMES,
        **GGUF_SPLIT_NAMES,
    },
)


class Olmo2ForCausalLM(DecoderForCausalLM):
    declaration = ModelDeclaration(
        params={
            "post_attn_norm": vector(("hidden", Split.HIDDEN)),
            "post_mlp_norm": vector(("hidden", Split.HIDDEN)),
            "q_norm": vector(("q", Split.Q_HEADS)),
            "k_norm": vector(("k", Split.KV_HEADS)),
            **PROJECTIONS,
        },
        layer_tensors={
            "post_attention_layernorm.weight": CheckpointTensor("post_attn_norm", ("hidden",)),
            "post_feedforward_layernorm.weight": CheckpointTensor("post_mlp_norm", ("hidden",)),
            "self_attn.q_norm.weight": CheckpointTensor("q_norm", ("q",)),
            "self_attn.k_norm.weight": CheckpointTensor("k_norm", ("k",)),
            **SPLIT_TENSORS,
        },
        lora_targets=SPLIT_LORA,
        gguf=OLMO2_GGUF,
    )

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        return Features(qk_norm="full")

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        for field in ("attention_bias", "clip_qkv"):
            if config.hf_config.get(field):
                raise refuse(field, config.hf_config[field], "null/false")
