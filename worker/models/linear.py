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

In bfloat16 the weight arrives in float32 (the checkpoint's, before any
rounding) so that its block codes can still be found; oneDNN gets it rounded to
bfloat16 (AMX / AVX512-BF16 kernels: 2x float32's speed for a 2,048-row
prefill on the AVX512-BF16 EPYC), while small batches keep running the codes in
float32 and round their output once. Measured there for a 3072x576 weight at 1
row: codes 0.075 ms per call-equivalent, oneDNN bf16 0.061 ms but the whole
model's projections per decode step 9 ms on codes vs 19 ms on oneDNN bf16 (the
codes read half the bytes).
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
# In bfloat16 oneDNN's bf16 kernels run twice as fast and the crossover falls
# to 12 rows on the AVX512-BF16 EPYC (`linear_bench.py --dtype bfloat16`: at
# 12 rows 24.9 vs 25.0 ms per step, at 16 rows 21.3 vs 28.7); AMX would move it
# lower still (not measured: no AMX machine in reach).
MAX_BLOCK_CODE_ROWS_BF16 = 12
# Where the kernels' level multiplies bfloat16 activations with vdpbf16ps
# (kernels/cpu_isa.py: avx512_bf16), a row costs half the multiply
# instructions and the codes stay ahead of oneDNN's bf16 matmul to more rows.
MAX_BLOCK_CODE_ROWS_BF16_DOT = 24


def onednn_available(weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether oneDNN can run ``weight`` in ``dtype`` (default: the weight's own)."""
    mkldnn_ops = torch.ops.mkldnn
    dtype = dtype or weight.dtype
    return (
        weight.device.type == "cpu"
        and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn_ops, "_reorder_linear_weight")
        and hasattr(mkldnn_ops, "_linear_pointwise")
    )


class PackedLinear:
    """A frozen weight (and bias) prepared once for inference, computing in
    ``dtype`` (default: the weight's; a float32 weight may run in bfloat16)."""

    __slots__ = (
        "_bias",
        "_codes",
        "_codes_take_bf16",
        "_packed",
        "in_features",
        "out_features",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_onednn: bool = True,
        use_block_codes: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        dtype = dtype or weight.dtype
        self._bias = None if bias is None else bias.to(dtype)
        self._codes: BlockCodes | None = None
        if use_block_codes and weight.device.type == "cpu" and native.unavailable_reason() is None:
            self._codes = find_block_codes(weight)  # float32 weights only
        level = native.loaded_level() if self._codes is not None else None
        self._codes_take_bf16 = level is not None and level.bf16_block_codes
        weight = weight.to(dtype)
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
        if x.dtype == torch.float32:
            max_rows = MAX_BLOCK_CODE_ROWS
        elif self._codes_take_bf16:
            max_rows = MAX_BLOCK_CODE_ROWS_BF16_DOT
        else:
            max_rows = MAX_BLOCK_CODE_ROWS_BF16
        if codes is not None and x.dim() == 2 and x.shape[0] <= max_rows:
            # bfloat16 rows go in as they are where the kernel multiplies them
            # natively (bf16 out), else as float32 (float32 out, rounded once).
            x_in = x if self._codes_take_bf16 else x.float()
            y = torch.ops.kvmesh.block_code_linear(
                x_in.contiguous(), codes.codes, codes.scales, codes.offsets, codes.out_features
            )
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
            return y if self._bias is None else y.add_(self._bias)
        if self._packed is None:
            return F.linear(x, self.weight, self._bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self._bias, "none", [], ""
        )
