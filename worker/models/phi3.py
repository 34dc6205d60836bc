"""Phi-3 / Phi-4 (dense): Llama's forward over fused ``qkv_proj`` and
``gate_up_proj`` checkpoint tensors (each run cut for TP like Llama's split
tensors), LongRoPE below its original length (worker/models/rotary.py)."""

from __future__ import annotations

from typing import Any

from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    GGUFMetadata,
    GGUFShapes,
    LoRATarget,
    ModelDeclaration,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.llama import GGUF_NORM_NAMES, NORM_TENSORS, NORMS, PROJECTIONS


def _phi3_gguf_config(meta: GGUFMetadata, shapes: GGUFShapes, hf: dict[str, Any]) -> None:
    # LongRoPE's factors travel as tensors (rope_factors_long/short), not keys.
    if "rope_factors_long.weight" in shapes or "rope_factors_short.weight" in shapes:
        raise UnsupportedModelError(
            "phi3 GGUF with LongRoPE factor tensors (rope_factors_long/short): not read "
            "yet; serve the Hugging Face checkpoint folder instead"
        )


# The converter keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding the
# gate rows then the up rows (llama.cpp's fused SwiGLU), nothing permuted.
PHI3_GGUF = GGUFLayout(
    architecture="phi3",
    hf_architecture="Phi3ForCausalLM",
    model_type="phi3",
    layer_names={
        **GGUF_NORM_NAMES,
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    config_hook=_phi3_gguf_config,
)


class Phi3ForCausalLM(DecoderForCausalLM):
    declaration = ModelDeclaration(
        params={**NORMS, **PROJECTIONS},
        layer_tensors={
            **NORM_TENSORS,
            "self_attn.qkv_proj.weight": CheckpointTensor("qkv_proj", ("q", "k", "v")),
            "self_attn.o_proj.weight": CheckpointTensor("o_proj", ("o",)),
            "mlp.gate_up_proj.weight": CheckpointTensor("gate_up_proj", ("gate", "up")),
            "mlp.down_proj.weight": CheckpointTensor("down_proj", ("down",)),
        },
        # PEFT adapts Phi-3's fused modules as they are.
        lora_targets={
            "qkv_proj": LoRATarget("self_attn.qkv_proj", "qkv_proj", ("q", "k", "v")),
            "o_proj": LoRATarget("self_attn.o_proj", "o_proj", ("o",)),
            "gate_up_proj": LoRATarget("mlp.gate_up_proj", "gate_up_proj", ("gate", "up")),
            "down_proj": LoRATarget("mlp.down_proj", "down_proj", ("down",)),
        },
        gguf=PHI3_GGUF,
    )
