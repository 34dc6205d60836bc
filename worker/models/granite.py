"""Granite (IBM Granite 3.x dense): Llama's layout with four multipliers, on
the embedding, each sublayer's residual branch, the attention scores (in
place of 1/sqrt(head_dim)) and the logits (divided)."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import llama_declaration


class GraniteForCausalLM(DecoderForCausalLM):
    declaration = llama_declaration(qkv_bias=False)

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        hf = config.hf_config
        return Features(
            attention_scale=float(hf.get("attention_multiplier", 1.0)),
            embed_scale=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            logits_divisor=float(hf.get("logits_scaling", 1.0)),
        )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        if config.hf_config.get("attention_bias"):
            raise refuse("attention_bias", True, "false")
