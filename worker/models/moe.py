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

On CPU with kvmesh's C++ ops loaded, steps of up to ``MAX_FUSED_TOKENS``
tokens (decode and small prefill chunks) run ``fused_experts`` instead: the
router as here, then one op (kernels/csrc/fused_moe_cpu.cpp) that sorts the
pairs, runs each active expert over its rows with its weights read once, and
sums each token's experts in the same expert order. Its expert weights may be
bfloat16 under float32 activations (widened in registers): exact where the
checkpoint is bfloat16, half the bytes a step reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh.kernels import batch_invariant

# Up to this many tokens a CPU step's experts run fused_experts, above it the
# grouped path (_grouped_mm). Measured by benchmarks/moe_layer_bench.py on the
# 2-core Zen 2 (docs/performance.md, "fused MoE").
MAX_FUSED_TOKENS = 4096


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
    gate_up: torch.Tensor,  # [E, 2 * I, H]
    down: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,
    gelu: bool,
    native_ops: bool,
) -> torch.Tensor:
    """The MoE MLP's output [T, H] by the path that fits: fused_experts where the
    C++ ops are loaded (``native_ops``), the step is on CPU, small enough and
    not batch-invariant; grouped_experts otherwise (with the weights in the
    activations' dtype: a float32 model may keep bfloat16 experts for the
    fused path)."""
    if (
        native_ops
        and hidden.device.type == "cpu"
        and hidden.shape[0] <= MAX_FUSED_TOKENS
        and not batch_invariant.enabled()
    ):
        return fused_experts(hidden, router, gate_up, down, top_k, renormalize, gelu)
    dtype = hidden.dtype
    return grouped_experts(
        hidden, router, gate_up.to(dtype), down.to(dtype), top_k, renormalize, gelu
    )


def fused_experts(
    hidden: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    gelu: bool = False,
) -> torch.Tensor:
    """grouped_experts' output by the C++ kernel (CPU, its ops loaded): the same
    routing, then every active expert's MLP over its rows in one op."""
    weights, experts = route(hidden, router, top_k, renormalize)
    # The routing weights as grouped_experts multiplies by them (rounded to
    # the hidden dtype), handed over in float32.
    return torch.ops.kvmesh.fused_moe(
        hidden.contiguous(), experts, weights.float(), gate_up, down, gelu
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
