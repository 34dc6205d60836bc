"""Mixture-of-experts MLP: top-k routing and the experts, grouped.

A step's (token, expert) pairs are sorted by expert, so each active expert's
tokens are one contiguous run; ``torch._grouped_mm`` then multiplies every run
by its expert's weights in one call (one pass over each active expert's
weights per step, no Python loop over experts), and one ``index_add_`` sums
each token's experts back, in expert order like transformers. Under tensor
parallelism every rank holds every expert's slice of the MLP width; the
caller's all-reduce sums the partial outputs as for a dense MLP.

In batch-invariant mode (kernels/batch_invariant.py) the grouped product is
not: an expert's run is as long as the number of the step's tokens routed to
it, and ``_grouped_mm`` sums a row's products in an order that changes with
that length, so a token's output would depend on which other tokens share its
step. There the router and every expert's run go through fixed
``ROW_TILE``-row tiles instead (one call per tile, one shape per call), at
the price of a Python loop over the active experts.

On CPU with kvmesh's C++ ops loaded, the layer packs its experts at load
into 16-feature panels (``pack_expert_panels``; bfloat16 words where every
weight is a bfloat16 value, as the dense projections keep them), and every
step runs ``fused_experts``: the router as here, then one op
(kernels/csrc/fused_moe_cpu.cpp) that sorts the pairs, runs each active expert
over its rows with its weights read once (a panel loop for decode-sized runs,
a blocked GEMM for prefill-sized ones) and sums each token's experts in the
same expert order. Each of its outputs is one chain of fused multiply-adds
whatever else the step holds, so it is batch-invariant as it stands and
batch-invariant mode runs it too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh.kernels import batch_invariant
from kvmesh.services.contracts.math_utils import cdiv

# Tokens per fused_experts call: a longer step runs in pieces of this many
# (exact: a token's output does not depend on the others), which bounds the
# kernel's scratch ([pairs, I] and [pairs, H] float32) to what a 2,048-token
# step of a 32-expert top-8 model with I = 768 would need at half the tokens.
FUSED_CHUNK_TOKENS = 1024
# Output features per panel (kernels/csrc/panel_tile.h).
PANEL_LANES = 16


def route(
    hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the hidden dtype, expert ids [T, k]): softmax over the
    router's logits in float32, the top k, renormalized to sum 1 if asked."""
    if batch_invariant.enabled():
        logits = batch_invariant.tiled_rows(hidden.contiguous(), lambda x: F.linear(x, router))
    else:
        logits = F.linear(hidden, router)
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden.dtype), experts


def moe_experts(
    hidden: torch.Tensor,  # [T, H]
    router: torch.Tensor,  # [E, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H], or its panels (pack_expert_panels)
    down: torch.Tensor,  # [E, H, I], or its panels
    top_k: int,
    renormalize: bool,
    gelu: bool,
) -> torch.Tensor:
    """The MoE MLP's output [T, H]: fused_experts over packed panels (a CPU
    layer with the C++ ops loaded packs them at load), grouped_experts over
    the plain weights otherwise."""
    if is_packed(gate_up):
        return fused_experts(hidden, router, gate_up, down, top_k, renormalize, gelu)
    return grouped_experts(hidden, router, gate_up, down, top_k, renormalize, gelu)


def is_packed(gate_up: torch.Tensor) -> bool:
    """Whether ``gate_up`` is pack_expert_panels' layout (5 dimensions)."""
    return gate_up.dim() == 5


def pack_expert_panels(
    gate_up: torch.Tensor, down: torch.Tensor, words: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts in fused_moe's panels, in ``words`` (float32, or bfloat16
    where every weight is a bfloat16 value: exact either way):

    - gate_up [E, ceil(I / 16), 2, H, 16]: pair j holds gate features
      16 j .. 16 j + 15, then the up features of the same columns;
    - down [E, ceil(H / 16), I, 16].

    Features past I (or H) are zero."""
    experts, double_width, hidden = gate_up.shape
    width = double_width // 2
    pairs = cdiv(width, PANEL_LANES)
    halves = torch.zeros(experts, 2, pairs * PANEL_LANES, hidden, dtype=words)
    halves[:, :, :width] = gate_up.view(experts, 2, width, hidden)
    # [E, 2, pairs, 16, H] -> [E, pairs, 2, H, 16]
    gate_up_panels = (
        halves.view(experts, 2, pairs, PANEL_LANES, hidden).permute(0, 2, 1, 4, 3).contiguous()
    )
    down_panel_count = cdiv(hidden, PANEL_LANES)
    rows = torch.zeros(experts, down_panel_count * PANEL_LANES, width, dtype=words)
    rows[:, :hidden] = down
    down_panels = (
        rows.view(experts, down_panel_count, PANEL_LANES, width).transpose(2, 3).contiguous()
    )
    return gate_up_panels, down_panels


def fused_experts(
    hidden: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    gelu: bool = False,
) -> torch.Tensor:
    """grouped_experts' output by the C++ kernel (CPU, its ops loaded) over the
    experts' panels (pack_expert_panels): the same routing, then every active
    expert's MLP over its rows in one op, FUSED_CHUNK_TOKENS tokens at a time."""
    if hidden.shape[0] > FUSED_CHUNK_TOKENS:
        return torch.cat(
            [
                fused_experts(piece, router, gate_up, down, top_k, renormalize, gelu)
                for piece in hidden.split(FUSED_CHUNK_TOKENS)
            ]
        )
    weights, experts = route(hidden, router, top_k, renormalize)
    # The routing weights as grouped_experts multiplies by them (rounded to
    # the hidden dtype), handed over in float32.
    return torch.ops.kvmesh.fused_moe(
        hidden.contiguous(), experts, weights.float(), gate_up, down, down.shape[2], gelu
    )


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
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    grouped = hidden[tokens]
    if batch_invariant.enabled():
        out = _tiled_experts(grouped, counts.tolist(), gate_up, down, gelu)
    else:
        ends = torch.cumsum(counts, 0).to(torch.int32)
        # The weights' transposed views: the kernel reads them in place ([E, H, 2I]),
        # each group's product equal to F.linear's.
        projected = torch._grouped_mm(grouped, gate_up.transpose(1, 2), offs=ends)
        out = torch._grouped_mm(_activate(projected, gelu), down.transpose(1, 2), offs=ends)
    # Each token's experts are summed in expert order (the sort's), one row of
    # index_add_ after another: the same order whatever else is in the step.
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    return out.new_zeros(num_tokens, hidden.shape[1]).index_add_(0, tokens, out)


def _activate(projected: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate, up = projected.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def _tiled_experts(
    grouped: torch.Tensor,  # [T * k, H], sorted by expert
    counts: list[int],  # rows of each expert, in expert order
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gelu: bool,
) -> torch.Tensor:
    """Each active expert's MLP over its run of ``grouped``, on fixed row tiles
    (batch-invariant mode): a row's sums depend on its expert, not on the run's length."""

    def linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: F.linear(x, weight)

    pieces: list[torch.Tensor] = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = grouped[start : start + count].contiguous()
        start += count
        activated = _activate(batch_invariant.tiled_rows(rows, linear(gate_up[expert])), gelu)
        pieces.append(batch_invariant.tiled_rows(activated.contiguous(), linear(down[expert])))
    if not pieces:
        return grouped.new_zeros(0, down.shape[1])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
