"""Dense projections (y = x Wᵀ + b) in the fastest layout the device offers.

On CPU in float32, oneDNN's linear over weights converted once to its own
tensor format streams the weights about 1.7x faster than the default BLAS
call measured here (decode at batch 16 on 2 cores: the 30 layers' four
projections went from ~47 ms to ~29 ms per step; `benchmarks/engine_bench.py`),
because a decode step is a sequence of skinny matmuls that read each weight
once from DRAM and the default path re-packs every weight on every call. The
results differ from the default path only in float rounding order.
Elsewhere (CUDA, other dtypes, no oneDNN) it is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear:
    """A frozen weight (and bias) prepared once for inference."""

    __slots__ = ("_bias", "_packed", "out_features", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, use_onednn: bool = True
    ) -> None:
        self.out_features = weight.shape[0]
        self._bias = bias
        if use_onednn and onednn_available(weight):
            self._packed: torch.Tensor | None = weight.contiguous().to_mkldnn()
            self.weight = None  # the packed copy replaces it: no second copy in memory
        else:
            self._packed = None
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self._bias)
        return torch._C._nn.mkldnn_linear(
            x.contiguous().to_mkldnn(), self._packed, self._bias
        ).to_dense()
