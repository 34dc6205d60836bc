"""Mixture-of-experts MLP: top-k routing and the experts, grouped.

A step's (token, expert) pairs are sorted by expert, so each active expert's
tokens are one contiguous run; ``torch._grouped_mm`` then multiplies every run
by its expert's weights in one call (one pass over each active expert's
weights per step, no Python loop over experts), and one ``index_add_`` sums
each token's experts back, in expert order like transformers. Under tensor
parallelism every rank holds every expert's slice of the MLP width; the
caller's all-reduce sums the partial outputs as for a dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the hidden dtype, expert ids [T, k]): softmax over the
    router's logits in float32, the top k, renormalized to sum 1 if asked."""
    probs = F.softmax(F.linear(hidden, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden.dtype), experts


def grouped_experts(
    hidden: torch.Tensor,  # [T, H]
    router: torch.Tensor,  # [E, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,
    gelu: bool = False,
) -> torch.Tensor:
    """The MoE MLP's output [T, H] (a partial sum under TP)."""
    num_tokens = hidden.shape[0]
    weights, experts = route(hidden, router, top_k, renormalize)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, then token, then rank
    tokens = order // top_k
    ends = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    grouped = hidden[tokens]
    # The weights' transposed views: the kernel reads them in place ([E, H, 2I]),
    # each group's product equal to F.linear's.
    projected = torch._grouped_mm(grouped, gate_up.transpose(1, 2), offs=ends)
    gate, up = projected.chunk(2, dim=-1)
    activated = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    out = torch._grouped_mm(activated, down.transpose(1, 2), offs=ends)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    return out.new_zeros(num_tokens, hidden.shape[1]).index_add_(0, tokens, out)
