"""Dense projections (y = x Wᵀ + b) in the fastest layout the device offers.

A decode step is a chain of skinny matmuls that each read one weight once.
On CPU in float32, oneDNN over weights reordered once into its blocked layout
(``mkldnn._reorder_linear_weight``) and called on plain dense activations
(``mkldnn._linear_pointwise``, the op PyTorch's own CPU compiler emits) ran the
30 layers' projections of SmolLM2 at batch 16 in 13.4 ms against 44.4 ms for
``F.linear`` on this 2-core machine (2048-token prefill: 0.84 s vs 1.9 s), with
float32 accuracy (relative error vs float64 ~7e-7, F.linear ~4e-7). The default
path re-packs every weight on every call. Elsewhere (CUDA, other dtypes, a torch
without these ops) it is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The reorder is tuned for a typical decode batch; any batch size works with it.
_BATCH_SIZE_HINT = 16


def onednn_available(weight: torch.Tensor) -> bool:
    mkldnn_ops = torch.ops.mkldnn
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn_ops, "_reorder_linear_weight")
        and hasattr(mkldnn_ops, "_linear_pointwise")
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
            self._packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _BATCH_SIZE_HINT
            )
            self.weight = None  # the packed copy replaces it: no second copy in memory
        else:
            self._packed = None
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self._bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self._bias, "none", [], ""
        )
