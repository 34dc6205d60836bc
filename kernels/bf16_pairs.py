"""A bfloat16 weight packed once in vdpbf16ps's pair layout for
``torch.ops.kvmesh.bf16_pair_linear`` (kernels/csrc/bf16_pair_linear.cpp).

Panels of 16 output features; within a panel, for each pair of input
features (2p, 2p + 1), 32 words: W[16 panel + l, 2p + j] at word 2l + j, the
order one vdpbf16ps multiplies against a broadcast pair of activations.
Output features past the weight's are zero rows.
"""

from __future__ import annotations

import torch

LANES = 16


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out_features, in_features]) can be packed: an even
    number of input features (the kernel reads them in pairs)."""
    return weight.dim() == 2 and weight.shape[1] % 2 == 0 and weight.shape[0] > 0


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] -> bfloat16 [panels, in_features / 2, 32],
    rounding to bfloat16 as ``Tensor.to`` does (nearest even)."""
    if not packable(weight):
        raise ValueError(f"cannot pack a {tuple(weight.shape)} weight in feature pairs")
    out_features, in_features = weight.shape
    panels = -(-out_features // LANES)
    padded = torch.zeros(panels * LANES, in_features, dtype=torch.bfloat16)
    padded[:out_features] = weight.to(torch.bfloat16)
    return (
        padded.view(panels, LANES, in_features // 2, 2)
        .permute(0, 2, 1, 3)
        .reshape(panels, in_features // 2, 2 * LANES)
        .contiguous()
    )
