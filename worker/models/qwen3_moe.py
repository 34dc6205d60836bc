"""Qwen3-MoE and Mixtral: attention as their dense siblings (Qwen3's q/k
norms; Mixtral's is Mistral's), the MLP a router over experts
(worker/models/moe.py). Experts are not LoRA targets; attention projections are."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    ModelDeclaration,
    ParamDecl,
    Part,
    Split,
    vector,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import NORM_TENSORS, NORMS, PROJECTIONS, SPLIT_LORA, SPLIT_TENSORS

_ATTENTION = ("qkv_proj", "o_proj")
_EXPERT = Split.EXPERT_INTERMEDIATE
EXPERT_PARAMS = {
    "router": ParamDecl((Part("experts", Split.EXPERTS),), Split.HIDDEN),
    "experts_gate_up": ParamDecl(
        (Part("gate", _EXPERT), Part("up", _EXPERT)), Split.HIDDEN, experts=True
    ),
    "experts_down": ParamDecl((Part("down", Split.HIDDEN),), _EXPERT, experts=True),
}


def moe_declaration(
    block: str, router: str, gate: str, up: str, down: str, qk_norm: bool
) -> ModelDeclaration:
    """A MoE family's declaration: its MLP's module ``block`` with a ``router``
    and experts whose gate/up/down matrices are named ``gate``/``up``/``down``."""
    params: dict[str, ParamDecl] = {
        **NORMS,
        **{name: PROJECTIONS[name] for name in _ATTENTION},
        **EXPERT_PARAMS,
    }
    tensors = {
        **NORM_TENSORS,
        **{k: v for k, v in SPLIT_TENSORS.items() if v.param in _ATTENTION},
        f"{block}.{router}.weight": CheckpointTensor("router", ("experts",)),
        f"{block}.experts.{{e}}.{gate}.weight": CheckpointTensor("experts_gate_up", ("gate",)),
        f"{block}.experts.{{e}}.{up}.weight": CheckpointTensor("experts_gate_up", ("up",)),
        f"{block}.experts.{{e}}.{down}.weight": CheckpointTensor("experts_down", ("down",)),
    }
    if qk_norm:
        params["q_norm"] = vector(("head", Split.HEAD_DIM))
        params["k_norm"] = vector(("head", Split.HEAD_DIM))
        tensors["self_attn.q_norm.weight"] = CheckpointTensor("q_norm", ("head",))
        tensors["self_attn.k_norm.weight"] = CheckpointTensor("k_norm", ("head",))
    return ModelDeclaration(
        params=params,
        layer_tensors=tensors,
        lora_targets={k: v for k, v in SPLIT_LORA.items() if v.param in _ATTENTION},
    )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    declaration = moe_declaration("mlp", "gate", "gate_proj", "up_proj", "down_proj", True)

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        hf = config.hf_config
        return Features(
            qk_norm="head",
            moe_top_k=int(hf["num_experts_per_tok"]),
            moe_renormalize=bool(hf.get("norm_topk_prob", False)),
        )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        hf = config.hf_config
        # Dense-MLP layers among the MoE ones are not declared here.
        if hf.get("mlp_only_layers"):
            raise refuse("mlp_only_layers", hf["mlp_only_layers"], "[]")
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise refuse("decoder_sparse_step", hf["decoder_sparse_step"], "1")
        if hf.get("attention_bias"):
            raise refuse("attention_bias", True, "false")


class MixtralForCausalLM(DecoderForCausalLM):
    declaration = moe_declaration("block_sparse_moe", "gate", "w1", "w3", "w2", False)

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        return Features(moe_top_k=int(config.hf_config["num_experts_per_tok"]))
