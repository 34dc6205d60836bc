"""A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint served
in float32), kept as its bfloat16 words in the panel layout of
``torch.ops.kvmesh.bf16_weight_linear`` (kernels/csrc/bf16_weight_linear.cpp).

Panels of 16 output features: ``panels[p, k, l] = W[16 p + l, k]``; output
features past the weight's are zero rows. Widening a word back to float32 is
exact, so the panels are the weight itself at half its bytes.

Any other float32 weight can take the same layout in float32 words
(``pack_float_panels``, for ``torch.ops.kvmesh.float_panel_linear``): on the
AVX2 level its cache-blocked GEMM runs prefill-sized batches faster than
oneDNN does (worker/models/linear.py).
"""

from __future__ import annotations

import torch

from kvmesh.services.contracts.math_utils import cdiv

LANES = 16


def exactly_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of float32 ``weight`` is a bfloat16 value (the low 16
    bits of each word are zero), so that its bfloat16 words lose nothing."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    low_bits = weight.contiguous().view(torch.int32) & 0xFFFF
    return not bool(low_bits.any())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out_features, in_features] (exactly bfloat16) -> bfloat16
    [panels, in_features, 16]."""
    if weight.dim() != 2 or not exactly_bfloat16(weight):
        raise ValueError("pack_panels: the weight is not an exactly bfloat16 matrix")
    out_features, in_features = weight.shape
    panels = cdiv(out_features, LANES)
    padded = torch.zeros(panels * LANES, in_features, dtype=torch.bfloat16)
    padded[:out_features] = weight.to(torch.bfloat16)  # exact: no rounding happens
    return padded.view(panels, LANES, in_features).transpose(1, 2).contiguous()


def pack_float_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out_features, in_features] -> float32 [panels, in_features, 16],
    the layout of ``torch.ops.kvmesh.float_panel_linear`` (the same panels as
    ``pack_panels``, in float32 words: any float32 weight)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError("pack_float_panels: the weight is not a float32 matrix")
    out_features, in_features = weight.shape
    panels = cdiv(out_features, LANES)
    padded = torch.zeros(panels * LANES, in_features, dtype=torch.float32)
    padded[:out_features] = weight
    return padded.view(panels, LANES, in_features).transpose(1, 2).contiguous()


def unpack_panels(
    panels: torch.Tensor, out_features: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight [out_features, in_features] the panels (bfloat16 or
    float32 words) hold, exactly,
    written into ``out`` (a float32 buffer of at least that many elements) when given."""
    count, in_features, lanes = panels.shape
    if lanes != LANES or not 0 < out_features <= count * LANES:
        raise ValueError(f"{tuple(panels.shape)} panels cannot hold {out_features} output features")
    if out is None:
        out = torch.empty(out_features * in_features, dtype=torch.float32)
    weight = out[: out_features * in_features].view(out_features, in_features)
    # One strided pass that widens as it copies (no bfloat16 intermediate).
    full = out_features // LANES
    weight[: full * LANES].view(full, LANES, in_features).copy_(panels[:full].transpose(1, 2))
    if full * LANES < out_features:
        weight[full * LANES :].copy_(panels[full, :, : out_features - full * LANES].t())
    return weight
