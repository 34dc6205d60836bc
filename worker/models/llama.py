"""The Llama family: Llama 1-3.x, Mistral, Qwen2/2.5 (q/k/v biases).

The plainest declaration: split q/k/v and gate/up checkpoint tensors fused
into ``qkv_proj`` and ``gate_up_proj``, two norms per layer, SwiGLU.
"""

from __future__ import annotations

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import qwen_layer_windows, refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    LayerKVSpec,
    LoRATarget,
    ModelDeclaration,
    ParamDecl,
    Split,
    proj,
    vector,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM

H, Q, KV, MLP = Split.HIDDEN, Split.Q_HEADS, Split.KV_HEADS, Split.INTERMEDIATE

# The four projections every Llama-shaped family has, and their PEFT names.
PROJECTIONS: dict[str, ParamDecl] = {
    "qkv_proj": proj(("q", Q), ("k", KV), ("v", KV), cols=H),
    "o_proj": proj(("o", H), cols=Q),
    "gate_up_proj": proj(("gate", MLP), ("up", MLP), cols=H),
    "down_proj": proj(("down", H), cols=MLP),
}
SPLIT_TENSORS: dict[str, CheckpointTensor] = {
    "self_attn.q_proj.weight": CheckpointTensor("qkv_proj", ("q",)),
    "self_attn.k_proj.weight": CheckpointTensor("qkv_proj", ("k",)),
    "self_attn.v_proj.weight": CheckpointTensor("qkv_proj", ("v",)),
    "self_attn.o_proj.weight": CheckpointTensor("o_proj", ("o",)),
    "mlp.gate_proj.weight": CheckpointTensor("gate_up_proj", ("gate",)),
    "mlp.up_proj.weight": CheckpointTensor("gate_up_proj", ("up",)),
    "mlp.down_proj.weight": CheckpointTensor("down_proj", ("down",)),
}
QKV_BIAS_TENSORS: dict[str, CheckpointTensor] = {
    "self_attn.q_proj.bias": CheckpointTensor("qkv_bias", ("q",)),
    "self_attn.k_proj.bias": CheckpointTensor("qkv_bias", ("k",)),
    "self_attn.v_proj.bias": CheckpointTensor("qkv_bias", ("v",)),
}
SPLIT_LORA: dict[str, LoRATarget] = {
    "q_proj": LoRATarget("self_attn.q_proj", "qkv_proj", ("q",)),
    "k_proj": LoRATarget("self_attn.k_proj", "qkv_proj", ("k",)),
    "v_proj": LoRATarget("self_attn.v_proj", "qkv_proj", ("v",)),
    "o_proj": LoRATarget("self_attn.o_proj", "o_proj", ("o",)),
    "gate_proj": LoRATarget("mlp.gate_proj", "gate_up_proj", ("gate",)),
    "up_proj": LoRATarget("mlp.up_proj", "gate_up_proj", ("up",)),
    "down_proj": LoRATarget("mlp.down_proj", "down_proj", ("down",)),
}
# llama.cpp's names of the same tensors.
GGUF_SPLIT_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's names of the two pre-norms.
GGUF_NORM_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
NORMS: dict[str, ParamDecl] = {
    "input_norm": vector(("hidden", H)),
    "pre_mlp_norm": vector(("hidden", H)),
}
NORM_TENSORS: dict[str, CheckpointTensor] = {
    "input_layernorm.weight": CheckpointTensor("input_norm", ("hidden",)),
    "post_attention_layernorm.weight": CheckpointTensor("pre_mlp_norm", ("hidden",)),
}


# llama.cpp's "llama" (Llama 1-3, Mistral: the converter's LlamaModel, which
# permutes q/k rows for its interleaved rope); "qwen2" keeps rows as they are.
LLAMA_GGUF = GGUFLayout(
    architecture="llama",
    hf_architecture="LlamaForCausalLM",
    model_type="llama",
    layer_names={**GGUF_NORM_NAMES, **GGUF_SPLIT_NAMES},
    permuted_qk=True,
)
QWEN2_GGUF = GGUFLayout(
    architecture="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    layer_names={**GGUF_NORM_NAMES, **GGUF_SPLIT_NAMES},
)


def llama_declaration(qkv_bias: bool, gguf: GGUFLayout | None) -> ModelDeclaration:
    params = {**NORMS, **PROJECTIONS}
    tensors = {**NORM_TENSORS, **SPLIT_TENSORS}
    if qkv_bias:
        params["qkv_bias"] = vector(("q", Q), ("k", KV), ("v", KV))
        tensors.update(QKV_BIAS_TENSORS)
    return ModelDeclaration(
        params=params,
        layer_tensors=tensors,
        lora_targets=SPLIT_LORA,
        gguf=gguf,
    )


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama and Mistral (every layer over Mistral's ``sliding_window``, as
    transformers' Mistral applies it)."""

    declaration = llama_declaration(qkv_bias=False, gguf=LLAMA_GGUF)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        # Llama's attention_bias biases o_proj too, which this layout lacks.
        if config.hf_config.get("attention_bias"):
            raise refuse("attention_bias", True, "false")


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2/2.5: Llama with q/k/v biases (``attention_bias`` unset in its config)."""

    declaration = llama_declaration(qkv_bias=True, gguf=QWEN2_GGUF)

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> list[LayerKVSpec]:
        windows = qwen_layer_windows(config.hf_config, config.num_layers)
        return [LayerKVSpec(config.num_kv_heads, config.head_dim, w) for w in windows]
