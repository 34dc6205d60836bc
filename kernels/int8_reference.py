"""W8A8 in plain torch: the reference kernels/csrc/int8_linear.cpp is tested against.

Activations are quantized per token (row), symmetric int8: ``a = max |x|``,
``q = round(x * (127 / a))`` (a float32 product, ties to even), scale
``a / 127``; weights are 8-bit block codes (kernels/block_codes.py). The
result is computed in float64 from the exact integer dot products, so that
only the kernel's float32 roundings separate the two.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.block_codes import BLOCK, LANES, BlockCodes


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` as int8-valued float32 codes, and the row's scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # 127 / a rounded once, as the kernel's float32 division: torch computes
    # ``127 / tensor`` as ``tensor.reciprocal() * 127`` (two roundings), an ulp
    # off now and then, which moved a tie like 70.5 to 71 (~1 draw in 1,700 of
    # the kernel test's 17 x 64 normal activations).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (x * inv).round_().clamp_(-127, 127)
    return q, (amax / 127).squeeze(-1)


def w8a8_reference(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    """``x`` [M, K] times the codes' weights, W8A8, in float64: [M, out_features]."""
    q, row_scales = quantize_rows(x)
    panels = codes.codes.shape[0]

    def rows(t: torch.Tensor) -> torch.Tensor:  # panel layout -> [out_features, ...]
        return t.permute(0, 2, 1).reshape(panels * LANES, -1)[: codes.out_features].double()

    w_codes = rows(codes.codes).view(codes.out_features, -1, BLOCK)  # [N, blocks, 32]
    q_blocks = q.double().view(q.shape[0], -1, BLOCK)  # [M, blocks, 32]
    dots = torch.einsum("mbk,nbk->mnb", q_blocks, w_codes)  # exact integers
    sums = q_blocks.sum(-1)  # [M, blocks]
    y = (dots * rows(codes.scales)).sum(-1) + sums @ rows(codes.offsets).T
    return y * row_scales.double()[:, None]
