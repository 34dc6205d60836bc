"""Granite (IBM Granite 3.x dense): Llama's layout with four multipliers, on
the embedding, each sublayer's residual branch, the attention scores (in
place of 1/sqrt(head_dim)) and the logits (divided)."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.declaration import GGUFLayout
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import GGUF_NORM_NAMES, GGUF_SPLIT_NAMES, llama_declaration

# The converter's GraniteModel is its LlamaModel (q/k rows permuted) plus the
# four multipliers as metadata.
GRANITE_GGUF = GGUFLayout(
    architecture="granite",
    hf_architecture="GraniteForCausalLM",
    model_type="granite",
    layer_names={**GGUF_NORM_NAMES, **GGUF_SPLIT_NAMES},
    permuted_qk=True,
    config_keys={
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
)


class GraniteForCausalLM(DecoderForCausalLM):
    declaration = llama_declaration(qkv_bias=False, gguf=GRANITE_GGUF)

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
