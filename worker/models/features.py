"""The switches a family's forward composes (vLLM's shared layers, as data).

A family states what is special about it here, once, from its config.json;
the decoder (worker/models/decoder.py) reads these flags when it is built, so
a Llama-shaped family runs the same code path, and fused kernels, as Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

QKNorm = Literal["", "head", "full"]
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: its base and its scaling dict (None: plain)."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True)
class Features:
    """How one family's decoder differs from Llama's (Llama: every default)."""

    # Which norms a layer has is its declaration's parameters (input_norm,
    # post_attn_norm, pre_mlp_norm, post_mlp_norm); these are the rest.
    # RMSNorm of q and k before the rotation: per head (Qwen3, Gemma 3, weight
    # [head_dim]) or over the whole projection (OLMo 2, weight [heads * head_dim]).
    qk_norm: QKNorm = ""
    # Gemma's norms scale by (1 + w), computed in float32.
    norm_offset: float = 0.0
    activation: Activation = "silu"
    # Softmax scale of q.k (None: head_dim ** -0.5).
    attention_scale: float | None = None
    # Embedding output multiplied by this (Gemma: sqrt(hidden), Granite's multiplier).
    embed_scale: float = 1.0
    # Each sublayer's output multiplied by this before the residual add (Granite).
    residual_multiplier: float = 1.0
    # Logits divided by this (Granite's logits_scaling).
    logits_divisor: float = 1.0
    # cap * tanh(logits / cap) on the final logits (Gemma 2), None: off.
    final_logit_softcap: float | None = None
    # cap * tanh(scores / cap) on every attention score before the softmax
    # (Gemma 2's attn_logit_softcapping; the attention backends apply it), None: off.
    attn_logit_softcap: float | None = None
    # Mixture of experts (layers with a ``router``): experts per token, and
    # whether their routing weights are renormalized to sum 1.
    moe_top_k: int = 0
    moe_renormalize: bool = True
    # The rotary tables, and which one each layer uses (None: table 0 everywhere).
    ropes: tuple[RopeSpec, ...] = ()
    layer_rope: tuple[int, ...] | None = None
    # Per layer, whether it skips the rotation altogether (SmolLM3's NoPE
    # layers: position reaches them only through the causal mask); None:
    # every layer rotates.
    layer_nope: tuple[bool, ...] | None = None

    @property
    def llama_mlp(self) -> bool:
        """Llama's residual/norm/SwiGLU after attention (where the layer has
        Llama's norms): the fused C++ path applies."""
        return (
            self.norm_offset == 0.0
            and self.activation == "silu"
            and self.residual_multiplier == 1.0
        )
