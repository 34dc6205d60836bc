"""SmolLM3: Llama's layout and forward, but every ``no_rope_layer_interval``-th
layer is a NoPE layer (config.json's ``no_rope_layers``: 1 rotates, 0 does not),
which sees positions only through the causal mask; ``use_sliding_window``
windows the layers ``layer_types`` names (transformers derives them: the NoPE
layers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.worker.config import ModelConfig
from kvmesh.worker.models.config_checks import UnsupportedModelError, refuse
from kvmesh.worker.models.declaration import GGUFLayout, LayerKVSpec
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.llama import GGUF_NORM_NAMES, GGUF_SPLIT_NAMES, llama_declaration

SLIDING = "sliding_attention"
_LAYER_TYPES = ("full_attention", SLIDING)
# llama.cpp's "smollm3": the converter's LlamaModel (q/k rows permuted), and no
# NoPE or window metadata: its graph hard-codes a NoPE layer every 4th layer
# (n_no_rope_layer_step = 4, as SmolLM3-3B's config says) and attends over
# every token (src/models/smollm3.cpp), which is what a file of it is served as.
SMOLLM3_GGUF = GGUFLayout(
    architecture="smollm3",
    hf_architecture="SmolLM3ForCausalLM",
    model_type="smollm3",
    layer_names={**GGUF_NORM_NAMES, **GGUF_SPLIT_NAMES},
    permuted_qk=True,
    config_fixed={"no_rope_layer_interval": 4, "use_sliding_window": False},
)


def rope_layers(hf: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Per layer, whether it rotates: config.json's ``no_rope_layers``, else (as
    transformers derives it) all but every ``no_rope_layer_interval``-th layer."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    return [bool(flag) for flag in flags[:num_layers]]


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """config.json's ``layer_types``, else transformers' derivation: a NoPE
    layer is windowed when ``use_sliding_window`` and a window are set."""
    types = hf.get("layer_types")
    if types:
        return list(types)[:num_layers]
    windowed = bool(hf.get("use_sliding_window")) and hf.get("sliding_window") is not None
    return [
        SLIDING if windowed and not rotates else "full_attention"
        for rotates in rope_layers(hf, num_layers)
    ]


class SmolLM3ForCausalLM(DecoderForCausalLM):
    declaration = llama_declaration(qkv_bias=False, gguf=SMOLLM3_GGUF)

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        rotates = rope_layers(config.hf_config, config.num_layers)
        return Features(layer_nope=tuple(not r for r in rotates))

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> list[LayerKVSpec]:
        hf = config.hf_config
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return [
            LayerKVSpec(
                config.num_kv_heads,
                config.head_dim,
                int(window) if kind == SLIDING and window is not None else None,
            )
            for kind in _layer_types(hf, config.num_layers)
        ]

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        hf, layers = config.hf_config, config.num_layers
        # Llama's attention_bias biases o_proj too, which this layout lacks.
        if hf.get("attention_bias"):
            raise refuse("attention_bias", True, "false")
        flags = hf.get("no_rope_layers")
        if flags is not None and (len(flags) < layers or any(f not in (0, 1) for f in flags)):
            raise refuse("no_rope_layers", flags, f"{layers} or more flags, each 0 or 1")
        if flags is None and int(hf.get("no_rope_layer_interval", 4)) < 1:
            raise refuse("no_rope_layer_interval", hf["no_rope_layer_interval"], "a positive int")
        types = _layer_types(hf, layers)
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if len(types) < layers or unknown:
            raise refuse("layer_types", unknown or types, f"{layers} of {', '.join(_LAYER_TYPES)}")
        if SLIDING in types and not (hf.get("use_sliding_window") and hf.get("sliding_window")):
            # transformers itself disagrees here: its sdpa/eager masks window
            # these layers, its flash-attention path does not.
            raise UnsupportedModelError(
                "config.json layer_types names sliding_attention layers without "
                "use_sliding_window=true and a sliding_window: which attention they get "
                "depends on transformers' attention implementation; supported: both set, "
                "or only full_attention layers"
            )
        super().check_config(config)
