"""A bfloat16 weight packed once in vdpbf16ps's pair layout for
``torch.ops.kvmesh.bf16_pair_linear`` (kernels/csrc/bf16_pair_linear.cpp).

Items of 32 output features; within an item, for each pair of input features
(2p, 2p + 1), 64 words: W[32 item + l, 2p + j] at word 2l + j, so that each
half (16 outputs, 32 words) is what one vdpbf16ps multiplies against a
broadcast pair of activations. Output features past the weight's are zero rows.
"""

from __future__ import annotations

import torch

from kvmesh.services.contracts.math_utils import cdiv

ITEM_OUTPUTS = 32


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out_features, in_features]) can be packed: an even
    number of input features (the kernel reads them in pairs)."""
    return weight.dim() == 2 and weight.shape[1] % 2 == 0 and weight.shape[0] > 0


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] -> bfloat16 [items, in_features / 2, 64],
    rounding to bfloat16 as ``Tensor.to`` does (nearest even)."""
    if not packable(weight):
        raise ValueError(f"cannot pack a {tuple(weight.shape)} weight in feature pairs")
    out_features, in_features = weight.shape
    items = cdiv(out_features, ITEM_OUTPUTS)
    padded = torch.zeros(items * ITEM_OUTPUTS, in_features, dtype=torch.bfloat16)
    padded[:out_features] = weight.to(torch.bfloat16)
    return (
        padded.view(items, ITEM_OUTPUTS, in_features // 2, 2)
        .permute(0, 2, 1, 3)
        .reshape(items, in_features // 2, 2 * ITEM_OUTPUTS)
        .contiguous()
    )


def unpack_pairs(pairs: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack_pairs``: the bfloat16 weight [out_features,
    in_features] the pairs hold, word for word."""
    items, half_features, words = pairs.shape
    if words != 2 * ITEM_OUTPUTS or not 0 < out_features <= items * ITEM_OUTPUTS:
        raise ValueError(f"{tuple(pairs.shape)} pairs cannot hold {out_features} output features")
    return (
        pairs.view(items, half_features, ITEM_OUTPUTS, 2)
        .permute(0, 2, 1, 3)
        .reshape(items * ITEM_OUTPUTS, 2 * half_features)[:out_features]
        .contiguous()
    )
