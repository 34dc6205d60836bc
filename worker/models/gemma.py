"""Gemma 2 and Gemma 3 (text): four norms per layer scaling by (1 + w), a
GELU-tanh MLP, the embedding scaled by sqrt(hidden), attention scaled by
``query_pre_attn_scalar``; Gemma 2 soft-caps its final logits, Gemma 3 norms
each q/k head and gives its sliding-window ("local") layers their own rotary
base. Sliding-window layers attend over their window only, and Gemma 2
soft-caps attention scores, both in the attention backends (kernels/reference.py)."""

from __future__ import annotations

from typing import Any

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import check_rope, refuse
from kvmesh.worker.models.declaration import (
    CheckpointTensor,
    GGUFLayout,
    GGUFMetadata,
    GGUFShapes,
    LayerKVSpec,
    ModelDeclaration,
    Split,
    vector,
)
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features, RopeSpec
from kvmesh.worker.models.llama import GGUF_SPLIT_NAMES, PROJECTIONS, SPLIT_LORA, SPLIT_TENSORS
from kvmesh.worker.models.qwen3 import GGUF_QK_NORM_NAMES

_HIDDEN = ("hidden", Split.HIDDEN)
SANDWICH_NORMS = {
    "input_norm": vector(_HIDDEN),
    "post_attn_norm": vector(_HIDDEN),
    "pre_mlp_norm": vector(_HIDDEN),
    "post_mlp_norm": vector(_HIDDEN),
}
SANDWICH_TENSORS = {
    "input_layernorm.weight": CheckpointTensor("input_norm", ("hidden",)),
    "post_attention_layernorm.weight": CheckpointTensor("post_attn_norm", ("hidden",)),
    "pre_feedforward_layernorm.weight": CheckpointTensor("pre_mlp_norm", ("hidden",)),
    "post_feedforward_layernorm.weight": CheckpointTensor("post_mlp_norm", ("hidden",)),
}
SLIDING = "sliding_attention"
GGUF_SANDWICH_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's model-size rule: its 27B Gemmas (by layer count) scale attention
# by hidden / heads, every other size by head_dim; query_pre_attn_scalar is
# not in the file.
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_gguf_config(meta: GGUFMetadata, shapes: GGUFShapes, hf: dict[str, Any]) -> None:
    arch = str(meta["general.architecture"])
    if hf["num_hidden_layers"] == _GGUF_27B_LAYERS[arch]:
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    else:
        hf["query_pre_attn_scalar"] = hf["head_dim"]


def _gemma3_gguf_config(meta: GGUFMetadata, shapes: GGUFShapes, hf: dict[str, Any]) -> None:
    """Gemma 3's layer pattern and its two rotary tables: the global one from
    ``rope.freq_base`` (and its linear scaling), the local one from
    ``rope.freq_base_swa`` (llama.cpp's 10,000 when absent)."""
    _gemma_gguf_config(meta, shapes, hf)
    layers = hf["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: True = sliding window
        sliding = [bool(flag) for flag in pattern]
    else:  # every pattern-th layer global (llama.cpp's set_swa_pattern)
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    hf["layer_types"] = [SLIDING if s else "full_attention" for s in sliding]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    scaling = hf.pop("rope_scaling", None)
    if scaling is not None:
        full.update(scaling)
    local = {
        "rope_type": "default",
        "rope_theta": float(meta.get("gemma3.rope.freq_base_swa", 1e4)),
    }
    hf["rope_parameters"] = {"full_attention": full, SLIDING: local}


def _gemma_gguf(arch: str, hf_architecture: str, names: dict[str, str]) -> GGUFLayout:
    """The converter's Gemma 2/3: ``w + 1`` stored for every norm, rows kept,
    the embedding scale applied by the model (not stored)."""
    return GGUFLayout(
        architecture=arch,
        hf_architecture=hf_architecture,
        model_type=arch if arch == "gemma2" else "gemma3_text",
        layer_names={**GGUF_SANDWICH_NAMES, **GGUF_SPLIT_NAMES, **names},
        norm_offset=1.0,
        config_keys={
            "attn_logit_softcapping": "attn_logit_softcapping",
            "final_logit_softcapping": "final_logit_softcapping",
        },
        config_fixed={
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        },
        config_hook=_gemma_gguf_config if arch == "gemma2" else _gemma3_gguf_config,
    )


def _layer_types(hf: dict[str, Any], num_layers: int, pattern: int) -> list[str]:
    """Each layer's attention type: config.json's list, else every
    ``pattern``-th layer full and the others sliding."""
    types = hf.get("layer_types")
    if types:
        return list(types)
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


class _GemmaBase(DecoderForCausalLM):
    activations = ("gelu_pytorch_tanh",)
    sliding_pattern = 2

    @classmethod
    def _features(cls, config: ModelConfig, **extra: Any) -> Features:
        hf = config.hf_config
        return Features(
            norm_offset=1.0,
            activation="gelu_tanh",
            attention_scale=float(hf.get("query_pre_attn_scalar", config.head_dim)) ** -0.5,
            embed_scale=config.hidden_size**0.5,
            final_logit_softcap=hf.get("final_logit_softcapping"),
            attn_logit_softcap=hf.get("attn_logit_softcapping") or None,
            **extra,
        )

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> list[LayerKVSpec]:
        window = config.hf_config.get("sliding_window")
        types = _layer_types(config.hf_config, config.num_layers, cls.sliding_pattern)
        return [
            LayerKVSpec(
                config.num_kv_heads,
                config.head_dim,
                int(window) if kind == SLIDING and window else None,
            )
            for kind in types
        ]

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        hf = config.hf_config
        cap = hf.get("attn_logit_softcapping")
        if cap is not None and not float(cap) > 0:
            raise refuse("attn_logit_softcapping", cap, "a positive number, or null")
        for field in ("attention_bias", "use_bidirectional_attention"):
            if hf.get(field):
                raise refuse(field, hf[field], "false")
        super().check_config(config)


class Gemma2ForCausalLM(_GemmaBase):
    declaration = ModelDeclaration(
        params={**SANDWICH_NORMS, **PROJECTIONS},
        layer_tensors={**SANDWICH_TENSORS, **SPLIT_TENSORS},
        lora_targets=SPLIT_LORA,
        gguf=_gemma_gguf("gemma2", "Gemma2ForCausalLM", {}),
    )

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        return cls._features(config)


def _gemma3_ropes(config: ModelConfig) -> tuple[RopeSpec, RopeSpec]:
    """(global, local) rotary tables from either config.json layout."""
    hf = config.hf_config
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full, local = dict(params["full_attention"]), dict(params.get(SLIDING) or {})
    else:
        full = dict(hf.get("rope_scaling") or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    specs = []
    for params_ in (full, local):
        rope_type = params_.get("rope_type", params_.get("type", "default"))
        scaling = None if rope_type == "default" else params_
        if scaling is not None:
            scaling.setdefault("max_position_embeddings", config.max_model_len)
        specs.append(RopeSpec(float(params_.get("rope_theta", 10_000.0)), scaling))
    return specs[0], specs[1]


class Gemma3ForCausalLM(_GemmaBase):
    sliding_pattern = 6
    declaration = ModelDeclaration(
        params={
            **SANDWICH_NORMS,
            **PROJECTIONS,
            "q_norm": vector(("head", Split.HEAD_DIM)),
            "k_norm": vector(("head", Split.HEAD_DIM)),
        },
        layer_tensors={
            **SANDWICH_TENSORS,
            **SPLIT_TENSORS,
            "self_attn.q_norm.weight": CheckpointTensor("q_norm", ("head",)),
            "self_attn.k_norm.weight": CheckpointTensor("k_norm", ("head",)),
        },
        lora_targets=SPLIT_LORA,
        gguf=_gemma_gguf("gemma3", "Gemma3ForCausalLM", GGUF_QK_NORM_NAMES),
    )

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        types = _layer_types(config.hf_config, config.num_layers, cls.sliding_pattern)
        return cls._features(
            config,
            qk_norm="head",
            ropes=_gemma3_ropes(config),
            layer_rope=tuple(1 if kind == SLIDING else 0 for kind in types),
        )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        max_positions = int(config.hf_config.get("max_position_embeddings") or 0)
        for rope, field in zip(_gemma3_ropes(config), ("full_attention", SLIDING), strict=True):
            check_rope(rope.scaling or {}, config.max_model_len, max_positions, field)
