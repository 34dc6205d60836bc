"""OLMo 2: norms after each sublayer (none before), and q/k RMSNorms over the
whole q and k projections (all heads at once: under TP one small all-reduce
of the sums of squares, worker/models/decoder.py)."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.declaration import CheckpointTensor, ModelDeclaration, Split, vector
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import PROJECTIONS, SPLIT_LORA, SPLIT_TENSORS


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
