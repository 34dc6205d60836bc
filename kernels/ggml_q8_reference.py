"""GGUF blocks times int8 activations in plain torch: the reference of
kernels/csrc/ggml_q8_linear.cpp (``--quantization w8a8`` on a GGUF file's blocks).

Activations are quantized per 32 features (one scale per block of x, as
llama.cpp's q8_0 activations): ``a = max |x|``, ``q = round(x * (127 / a))``
(a float32 product, ties to even), scale ``a / 127``. The weights are the
``gguf`` package's dequantization of the blocks. The product runs in float64,
so only the kernel's float32 roundings (and its factoring of each weight as
``a * code + b``) separate the two.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from kvmesh.kernels.ggml_blocks import GGMLRows

RUN = 32  # features per activation scale


def quantize_runs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as int8-valued float32 codes and one scale per 32 features [M, K / 32]."""
    runs = x.float().reshape(x.shape[0], -1, RUN)
    amax = runs.abs().amax(dim=-1, keepdim=True)
    # 127 / a as one float32 division, as the kernel computes it (torch's
    # ``127 / tensor`` is a reciprocal then a product: an ulp off now and then).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (runs * inv).round_().clamp_(-127, 127)
    return q.reshape(x.shape), (amax / 127).squeeze(-1)


def ggml_q8_reference(x: torch.Tensor, rows: GGMLRows) -> torch.Tensor:
    """``x`` [M, K] (quantized per 32 features) times ``rows``' weights, in float64."""
    q, scales = quantize_runs(x)
    x_hat = (q.reshape(q.shape[0], -1, RUN).double() * scales.double()[..., None]).reshape(q.shape)
    weights = [
        torch.from_numpy(np.array(gguf_dequantize(s.blocks.numpy(), s.kind), dtype=np.float64))
        for s in rows.segments
    ]
    return x_hat @ torch.cat([w.reshape(-1, rows.in_features) for w in weights]).T
