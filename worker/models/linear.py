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

Small batches (decode steps) of a weight that is exactly a set of 8-bit block
codes (a checkpoint converted from GGUF Q4_1/Q8_0, such as the default model;
kernels/block_codes.py proves it bit for bit at load) run the C++ kernel over
the codes instead: a quarter of the bytes to read per weight, the very same
float32 weights and arithmetic. Large batches (prefill) stay on oneDNN, which
is compute-bound there and faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native
from kernels.block_codes import BlockCodes, find_block_codes

# The reorder is tuned for a typical decode batch; any batch size works with it.
_BATCH_SIZE_HINT = 16
# Up to this many rows the block-code kernel beats oneDNN on the default model
# (benchmarks/linear_bench.py); above it the matmul is compute-bound.
MAX_BLOCK_CODE_ROWS = 32


def onednn_available(weight: torch.Tensor) -> bool:
    mkldnn_ops = torch.ops.mkldnn
    return (
        weight.device.type == "cpu"
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn_ops, "_reorder_linear_weight")
        and hasattr(mkldnn_ops, "_linear_pointwise")
    )


class PackedLinear:
    """A frozen weight (and bias) prepared once for inference."""

    __slots__ = ("_bias", "_codes", "_packed", "in_features", "out_features", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_onednn: bool = True,
        use_block_codes: bool = True,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self._bias = bias
        self._codes: BlockCodes | None = None
        if use_block_codes and weight.device.type == "cpu" and native.unavailable_reason() is None:
            self._codes = find_block_codes(weight)
        if use_onednn and onednn_available(weight):
            self._packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _BATCH_SIZE_HINT
            )
            self.weight = None  # the packed copy replaces it: no second copy in memory
        else:
            self._packed = None
            self.weight = weight

    @property
    def uses_block_codes(self) -> bool:
        return self._codes is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes = self._codes
        if codes is not None and x.dim() == 2 and x.shape[0] <= MAX_BLOCK_CODE_ROWS:
            y = torch.ops.kvmesh.block_code_linear(
                x.contiguous(), codes.codes, codes.scales, codes.offsets, codes.out_features
            )
            return y if self._bias is None else y.add_(self._bias)
        if self._packed is None:
            return F.linear(x, self.weight, self._bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self._bias, "none", [], ""
        )
