"""Rotary position embeddings (the rotate-half layout used by Llama checkpoints)."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: stretch long wavelengths, keep short ones."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: interpolate the long wavelengths, keep the short ones, ramp between
    (the correction range from beta_fast/beta_slow rotations)."""
    factor = float(scaling["factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original_len / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(scaling: dict[str, Any] | None, max_positions: int) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1 otherwise)."""
    if scaling is None:
        return 1.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("attention_factor") is not None and rope_type in ("yarn", "longrope"):
        return float(scaling["attention_factor"])
    if rope_type == "yarn":
        factor = float(scaling["factor"])

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return mscale(factor, float(scaling["mscale"])) / mscale(
                factor, float(scaling["mscale_all_dim"])
            )
        return mscale(factor)
    if rope_type == "longrope":
        original_len = float(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_positions / original_len)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    return 1.0


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK equals plain rotary up to max_position_embeddings, the
        # bound worker/models/config_checks.py holds max_model_len to.
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if rope_type == "longrope":
        # The short factors: the table below original_max_position_embeddings,
        # the bound config_checks holds max_model_len to.
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**exponents)
    raise NotImplementedError(f"rope scaling {rope_type!r} is not supported")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # Same float32 products as transformers (positions x inv_freq), so the
        # tables are bit-identical to the oracle's.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        scale = attention_factor(scaling, int((scaling or {}).get("max_position_embeddings", 0)))
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.half_dim = head_dim // 2
        # Set by the model once the C++ ops are known to load (float32 or bfloat16).
        self.use_native = False

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, H_kv, D] -> rotated copies."""
        cos, sin = self.tables(positions)
        return self.rotate(query, cos, sin), self.rotate(key, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, D/2]: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate every head of ``x`` [T, heads, D] (query and key heads may come together)."""
        if self.use_native:
            # One C++ op with the same float ops and, in bfloat16, the same
            # roundings (kernels/csrc/rotary_cpu.cpp).
            return torch.ops.kvmesh.rotary_embedding(x, cos, sin)
        x1, x2 = x[..., : self.half_dim], x[..., self.half_dim :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
