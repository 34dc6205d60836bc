"""Batched LoRA in plain torch: the reference every LoRA kernel is tested against.

One step mixes tokens of several adapters and of the base model. Each token
carries the index of its adapter's slot (-1: base model, no delta); the delta
is grouped by slot (Punica/S-LoRA): for each slot, one *shrink* of its tokens
to the rank (``x A_sᵀ``) and one *expand* back (``· B_sᵀ``), added in place.
"""

from __future__ import annotations

import torch


def add_lora_reference(
    y: torch.Tensor,  # [num_tokens, out] base projection output, updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, rank] (scaling folded in)
    token_slots: torch.Tensor,  # [num_tokens] int, -1 = no adapter
) -> torch.Tensor:
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        shrunk = x[rows] @ lora_a[slot].t()
        y.index_add_(0, rows, shrunk @ lora_b[slot].t())
    return y
