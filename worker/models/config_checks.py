"""Refuse, at start-up, config.json features kvmesh does not implement.

Serving a checkpoint while ignoring one of its fields gives silently different
output from the model's own implementation; every field named here is either
implemented exactly or refused with its name and what is supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# rope_scaling types the rotary tables implement (worker/models/rotary.py).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Fields of multi-head latent attention (DeepSeek V2/V3): another attention.
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


class UnsupportedModelError(ValueError):
    """A checkpoint whose config asks for something kvmesh does not implement."""


def refuse(field: str, value: Any, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"config.json field {field}={value!r} is not implemented by kvmesh; supported: {supported}"
    )


def sliding_window_of(hf_config: Mapping[str, Any]) -> int | None:
    """The config's attention window (None: full attention). Qwen2/Qwen3 write a
    window but apply it only with ``use_sliding_window``."""
    if hf_config.get("use_sliding_window") is False:
        return None
    window = hf_config.get("sliding_window")
    return int(window) if window else None


def rope_parameters(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope dict of either config.json layout (``rope_parameters`` of
    transformers >= 5, ``rope_scaling`` before), without per-layer-type nesting."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()):
        return dict(params)
    scaling = hf_config.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, dict) else {}


def check_rope(
    rope: Mapping[str, Any], max_model_len: int, max_positions: int, field: str = "rope_scaling"
) -> None:
    """Refuse a rope type (or a length) the tables would not reproduce exactly."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise refuse(f"{field}.rope_type", rope_type, ", ".join(ROPE_TYPES))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"{field}.partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
    # Both re-derive their frequencies from the running length past a bound:
    # below it they are one fixed table, which is what kvmesh serves.
    bound = {
        "dynamic": max_positions,
        "longrope": int(rope.get("original_max_position_embeddings") or 0),
    }.get(rope_type)
    if bound is not None and max_model_len > bound:
        raise UnsupportedModelError(
            f"{field}.rope_type={rope_type!r} changes its frequencies past {bound} tokens, "
            f"which kvmesh does not implement: pass --max-model-len <= {bound}"
        )


def check_common(
    hf_config: Mapping[str, Any],
    max_model_len: int,
    activations: Iterable[str] = ("silu",),
) -> None:
    """The checks every family shares (a family adds its own fields' checks)."""
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise refuse(
            "quantization_config.quant_method",
            method,
            "none (float16/bfloat16/float32 safetensors, or a GGUF file; "
            "--quantization int8/w8a8 quantizes at load)",
        )
    for field in _MLA_FIELDS:
        if hf_config.get(field):
            raise refuse(field, hf_config[field], "none (multi-head latent attention)")
    sinks = sorted(k for k, v in hf_config.items() if "sink" in k.lower() and v)
    if sinks:
        raise refuse(sinks[0], hf_config[sinks[0]], "none (attention sinks)")
    activation = hf_config.get("hidden_act", hf_config.get("hidden_activation", "silu"))
    if activation not in tuple(activations):
        raise refuse("hidden_act", activation, ", ".join(activations))
    if hf_config.get("mlp_bias"):
        raise refuse("mlp_bias", True, "false")
    if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor", hf_config["partial_rotary_factor"], "1.0")
    max_positions = int(hf_config.get("max_position_embeddings") or max_model_len)
    field = (
        "rope_parameters" if isinstance(hf_config.get("rope_parameters"), dict) else "rope_scaling"
    )
    check_rope(rope_parameters(hf_config), max_model_len, max_positions, field)


def check_windows(windows: Iterable[int | None], field: str) -> None:
    """Every window is a positive token count (the kernels attend over the
    last ``window`` tokens: kernels/reference.py); anything else is refused."""
    for window in windows:
        if window is not None and window < 1:
            raise refuse(field, window, "a positive number of tokens, or null")


def qwen_layer_windows(hf_config: Mapping[str, Any], num_layers: int) -> list[int | None]:
    """Qwen2/Qwen3's windowed layers: config.json's ``layer_types``, else
    (as transformers derives them) the layers from ``max_window_layers`` on."""
    window = sliding_window_of(hf_config)
    if window is None:
        return [None] * num_layers
    types = hf_config.get("layer_types")
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    first = int(hf_config.get("max_window_layers", 28))
    return [window if i >= first else None for i in range(num_layers)]
