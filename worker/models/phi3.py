"""Phi-3 / Phi-4 (dense): Llama's forward over fused ``qkv_proj`` and
``gate_up_proj`` checkpoint tensors (each run cut for TP like Llama's split
tensors), LongRoPE below its original length (worker/models/rotary.py)."""

from __future__ import annotations

from kvmesh.worker.models.declaration import CheckpointTensor, LoRATarget, ModelDeclaration
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.llama import NORM_TENSORS, NORMS, PROJECTIONS


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
    )
