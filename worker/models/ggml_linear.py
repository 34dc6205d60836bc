"""A projection held only as a GGUF file's blocks (K-quants, Q5_0/Q5_1, mixes).

Up to ``MAX_GGML_KERNEL_ROWS`` rows (decode batches) run
kernels/csrc/ggml_block_linear.cpp over the blocks: each output row's blocks
are rebuilt once per call into an L1-sized buffer and dotted with every row of
x, so the weight bytes read per step are the file's (4.5 bits per weight for
Q4_K). Larger batches (prefill chunks) rebuild a tile of output rows at a
time into a thread-local float32 scratch buffer (``TILE_FLOATS``: a few MB, not
a copy of the weight) and multiply it with oneDNN (or F.linear), tile after
tile: the same float32 weights, a GEMM's speed, and memory that does not grow
with the projection (the 49k-row LM head included).

With ``--quantization w8a8`` the kernel rows take activations quantized to
int8 per 32 features and integer dot products (llama.cpp's own arithmetic for
its CPU decode): at batch 1 kernels/csrc/ggml_q8_linear.cpp (the blocks read
once and unpacked in registers, no float rebuild, 2.5-3.4x faster per pass),
from ``PANEL_MIN_ROWS`` rows ggml_q8_panel.cpp (a tile of rows unpacked once
per call into an L1 panel that every row of x reads; docs/performance.md);
prefill tiles stay float32.

On the avx2 level (``native.blocked_gemm_loaded``) batches from
``FLOAT_GEMM_MIN_ROWS`` rows (``FLOAT_GEMM_MIN_ROWS_W8A8`` with int8
activations), prefill chunks included, run kernels/csrc/ggml_float_gemm.cpp
instead: each k slice of 16-row panels dequantized once per call into float32
panels in L2 and the blocked GEMM's 6 x 16 micro-kernel over every row of x
(the same float32 weights as the tiles; faster than the int8 panel from 10
rows and than the tiles at every size measured).

The computation is float32 whatever the model's dtype: bfloat16 rows are
widened on the way in and the output rounded once, as the block-code kernel
does for rows it does not multiply natively.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kvmesh.kernels import native
from kvmesh.kernels.ggml_blocks import GGMLRows
from kvmesh.worker.models.linear import PackedLinear, onednn_available

# Up to this many rows the kernel over the blocks runs the projection; past it,
# tiles rebuilt into scratch and a GEMM. `benchmarks/decode_bandwidth.py
# --crossover` on the 2-core Zen 2 EPYC (AVX2; loaded box), the default model's
# Q4_K_M, all 121 projections, kernel vs tiles ms per pass: 1 row 826 vs 4,953,
# 16: 2,800 vs 5,469, 32: 3,426 vs 9,858, 128: 6,328 vs 14,789 (the kernel
# ahead at every size measured; larger batches unmeasured). The same bound as
# MAX_CODES_ONLY_KERNEL_ROWS for the panel codes.
MAX_GGML_KERNEL_ROWS = 128
# The same bound with --quantization w8a8 (int8 activations): past it the float
# tiles above. benchmarks/ggml_q8_bench.py on the same Zen 2 (1 thread, one
# Q4_K_M layer, ms of CPU time int8 panel / tiles, two runs): 40 rows 6.751 /
# 7.049 and 6.759 / 7.745; 48: 8.063 / 7.965 and 8.043 / 8.948; 56: 9.485 /
# 9.119; 64: 10.706 / 10.062 and 10.502 / 10.315 (docs/performance.md,
# "Decode batches on GGUF blocks").
MAX_GGML_Q8_KERNEL_ROWS = 48
# From this many rows of x the float32 GEMM over dequantized panels
# (ggml_float_gemm) runs the projection, decode batches and prefill chunks
# alike, where the blocked GEMM is built (the avx2 level). benchmarks/
# ggml_q8_bench.py on the 2-core Zen 2 EPYC (AVX2), 1 thread, one Q4_K_M layer
# (Q5_0 + Q6_K), ms of CPU time, float kernel / float GEMM: 2 rows 1.029 /
# 1.039, 3: 1.198 / 1.064 and 1.244 / 1.168, 4: 1.377 / 1.084, 16: 3.521 /
# 2.130; tiles + oneDNN at 64 / 1,024 rows 8.795 / 109.4 against the GEMM's
# 5.706 / 87.2 (docs/performance.md, "Decode batches on GGUF blocks: float32
# panels dequantized once per call").
FLOAT_GEMM_MIN_ROWS = 3
# The same with --quantization w8a8: below it the int8 kernels (rows, panel).
# Same benchmark, int8 panel / float GEMM (Q8_0: int8 rows kernel / GEMM), two
# runs: 6 rows 1.281 / 1.184 and 1.341 / 1.303 (Q8_0 1.204 / 1.120, 1.243 /
# 1.308), 7: 1.475 / 1.819, 8: 1.542 / 1.554 and 1.625 / 1.875 (Q8_0 1.543 /
# 1.518, 1.557 / 1.567), 9: 1.792 / 1.743 (Q8_0 1.782 / 1.586), 10: 1.911 /
# 1.559. The GEMM's cost steps every 6 rows (its register tile): 6 rows fill
# one tile, 7-8 pay for a second one nearly empty. Whole decode steps of the
# default model's Q4_K_M (benchmarks/decode_batch_profile.py --ab, 1 thread,
# CPU time, int8 kernels -> GEMM from this row count): 9 rows 86.0 -> 91.3 ms,
# 10: 92.9 -> 92.6, 12: 106.2 -> 97.2, 16: 133.4 -> 119.1; hence 10, not 9.
FLOAT_GEMM_MIN_ROWS_W8A8 = 10
# Floats of weight rebuilt per prefill tile (4 MB): big enough that oneDNN's
# GEMM runs at speed, small enough to stay in the L2/L3 caches.
TILE_FLOATS = 1 << 20


class _Scratch(threading.local):
    buffer: torch.Tensor | None = None


_scratch = _Scratch()


def _scratch_rows(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] view of the thread's scratch buffer."""
    size = rows * cols
    if _scratch.buffer is None or _scratch.buffer.numel() < size:
        with torch.inference_mode(False):  # writable outside inference mode too
            _scratch.buffer = torch.empty(size, dtype=torch.float32)
    return _scratch.buffer[:size].view(rows, cols)


class GGMLLinear(PackedLinear):
    """``PackedLinear``'s interface over ``GGMLRows`` (codes only, no dense copy)."""

    __slots__ = ("_float_gemm", "_rows")

    def __init__(
        self,
        rows: GGMLRows,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        use_kernel: bool = True,
        use_onednn: bool = True,
        int8_activations: bool = False,
    ) -> None:
        # Deliberately not PackedLinear.__init__: there is no dense weight to pack.
        self._rows = rows
        self.out_features, self.in_features = rows.shape
        self._dtype = dtype
        self._bias = None if bias is None else bias.to(dtype)
        self._onednn = use_onednn
        self._kernel = use_kernel and native.unavailable_reason() is None
        self._codes = None
        self._codes_take_bf16 = False
        self._codes_on_amx = False
        self._amx_plain = False
        self._pairs = None
        # --quantization w8a8: decode batches on int8 activations (llama.cpp's
        # arithmetic; kernels/csrc/ggml_q8_linear.cpp), prefill tiles as above.
        self._int8_activations = int8_activations and self._kernel
        self._float_gemm = self._kernel and native.blocked_gemm_loaded()
        self._packed = None
        self.weight = None

    @property
    def rows(self) -> GGMLRows:
        return self._rows

    @property
    def uses_block_codes(self) -> bool:
        return self._kernel

    @property
    def takes_int8_rows(self) -> bool:
        """A decode row is ``rows.linear_int8`` of it and nothing more (int8
        activations, no bias): what a fused C++ layer may call in its place."""
        return self._int8_activations and self._bias is None

    @property
    def codes_only(self) -> bool:
        return True

    @property
    def resident_bytes(self) -> int:
        return self._rows.nbytes

    def dense_weight(self) -> torch.Tensor:
        return self._rows.dequantize().to(self._dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        gemm_from = FLOAT_GEMM_MIN_ROWS_W8A8 if self._int8_activations else FLOAT_GEMM_MIN_ROWS
        limit = MAX_GGML_Q8_KERNEL_ROWS if self._int8_activations else MAX_GGML_KERNEL_ROWS
        if self._float_gemm and rows >= gemm_from:
            x32 = x.reshape(rows, self.in_features).float().contiguous()
            y = self._rows.float_gemm(x32).view(*x.shape[:-1], self.out_features)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        elif self._kernel and x.dim() == 2 and x.shape[0] <= limit:
            x32 = x.float().contiguous()
            y = self._rows.linear_int8(x32) if self._int8_activations else self._rows.linear(x32)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        else:
            y = self.linear_by_tiles(x)
        return y if self._bias is None else y.add_(self._bias)

    def linear_by_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill: rebuild a tile of output rows at a time, GEMM each tile."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
        tile = max(16, TILE_FLOATS // self.in_features // 16 * 16)
        for start in range(0, self.out_features, tile):
            stop = min(self.out_features, start + tile)
            weight = self._rebuild(start, stop)
            if weight.dtype != x.dtype:
                weight = weight.to(x.dtype)
            if self._onednn and onednn_available(weight) and x2.shape[0] > 0:
                part = torch.ops.mkldnn._linear_pointwise(x2, weight, None, "none", [], "")
            else:
                part = F.linear(x2, weight)
            y[:, start:stop] = part
        return y.view(*lead, self.out_features)

    def _rebuild(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) in float32, in the thread's scratch buffer when the
        kernels are loaded (valid until the next rebuild)."""
        if not self._kernel:
            return self._rows.dequantize_rows(start, stop)
        out = _scratch_rows(stop - start, self.in_features)
        first = 0
        for segment in self._rows.segments:
            count = segment.blocks.shape[0]
            lo, hi = max(start, first), min(stop, first + count)
            if lo < hi:
                torch.ops.kvmesh.ggml_dequantize_into(
                    segment.blocks[lo - first : hi - first],
                    int(segment.kind),
                    out[lo - start : hi - start],
                )
            first += count
        return out
