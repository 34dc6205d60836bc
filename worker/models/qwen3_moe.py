"""Qwen3-MoE and Mixtral: attention as their dense siblings (Qwen3's q/k
norms; Mixtral's is Mistral's), the MLP a router over experts
(worker/models/moe.py). Experts are not LoRA targets; attention projections are."""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    ModelDeclaration,
    ParamDecl,
    Part,
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
from kvmesh.worker.models.qwen3 import GGUF_QK_NORM_NAMES

_ATTENTION = ("qkv_proj", "o_proj")
_EXPERT = Split.EXPERT_INTERMEDIATE
EXPERT_PARAMS = {
    "router": ParamDecl((Part("experts", Split.EXPERTS),), Split.HIDDEN),
    "experts_gate_up": ParamDecl(
        (Part("gate", _EXPERT), Part("up", _EXPERT)), Split.HIDDEN, experts=True
    ),
    "experts_down": ParamDecl((Part("down", Split.HIDDEN),), _EXPERT, experts=True),
}


def gguf_moe_names(block: str, router: str, gate: str, up: str, down: str) -> dict[str, str]:
    """llama.cpp's MoE tensors: the router, and each expert matrix kind as one
    stack over the experts (``ffn_*_exps``: [experts, rows, cols])."""
    return {
        "ffn_gate_inp": f"{block}.{router}",
        "ffn_gate_exps": f"{block}.experts.{{e}}.{gate}",
        "ffn_up_exps": f"{block}.experts.{{e}}.{up}",
        "ffn_down_exps": f"{block}.experts.{{e}}.{down}",
    }


def moe_declaration(
    block: str,
    router: str,
    gate: str,
    up: str,
    down: str,
    qk_norm: bool,
    gguf: GGUFLayout,
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
        gguf=gguf,
    )


# llama.cpp's qwen3moe graph always renormalizes the top-k weights (the file
# may say so with expert_weights_norm); Mixtral is its "llama" with experts.
QWEN3_MOE_GGUF = GGUFLayout(
    architecture="qwen3moe",
    hf_architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    layer_names={
        **GGUF_NORM_NAMES,
        **GGUF_QK_NORM_NAMES,
        **GGUF_SPLIT_NAMES,
        **gguf_moe_names("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    },
    config_keys={
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_weights_norm": "norm_topk_prob",
    },
    config_fixed={"norm_topk_prob": True},
    experts=True,
)
MIXTRAL_GGUF = GGUFLayout(
    architecture="llama",
    hf_architecture="MixtralForCausalLM",
    model_type="mixtral",
    layer_names={
        **GGUF_NORM_NAMES,
        **GGUF_SPLIT_NAMES,
        **gguf_moe_names("block_sparse_moe", "gate", "w1", "w3", "w2"),
    },
    permuted_qk=True,
    config_keys={"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    experts=True,
)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    declaration = moe_declaration(
        "mlp", "gate", "gate_proj", "up_proj", "down_proj", True, QWEN3_MOE_GGUF
    )

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
    declaration = moe_declaration("block_sparse_moe", "gate", "w1", "w3", "w2", False, MIXTRAL_GGUF)

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        return Features(moe_top_k=int(config.hf_config["num_experts_per_tok"]))
