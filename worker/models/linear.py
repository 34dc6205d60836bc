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

Where the C++ kernels carry a cache-blocked float32 GEMM (the avx2 level:
kernels/csrc/bf16_weight_linear.cpp, 6 x 16 register tiles over k slices kept
in L2, ~82-86% of the FMA peak against oneDNN's ~68% on the 2-core Zen 2), a
float32 weight is kept as float32 panels instead of oneDNN's copy (the same
bytes) and every batch runs there: ``float_panels_win`` has the figures.

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

A dense bfloat16 weight (no block codes) on a CPU whose kernels run AMX tiles
stays plain, with no oneDNN-packed copy: up to ``MAX_AMX_LINEAR_ROWS`` rows
run kernels/csrc/amx_linear.cpp, which reads it in place (a decode step's
rows at ~1.25x oneDNN's prepacked speed there), and larger batches oneDNN on
the plain weight, which it reorders inside the call.

A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint served
in float32, as on a CPU without bfloat16 dot products) is kept only as its
bfloat16 words (kernels/bf16_weights.py): half the memory, and up to
``MAX_BF16_WEIGHT_KERNEL_ROWS`` rows run kernels/csrc/bf16_weight_linear.cpp,
which reads those 2 bytes per weight and widens them in registers (exact)
before float32 multiply-adds; larger batches widen the weight into the
thread's scratch buffer and run oneDNN on it, as codes-only weights do.

Quantized weights (a GGUF file's Q4_0/Q4_1/Q8_0 tensors, ``--quantization
int8``) keep ONLY their codes (``PackedLinear.from_codes``): up to
``MAX_CODES_ONLY_KERNEL_ROWS`` rows (decode batches) run the kernel, larger
ones (prefill chunks) rebuild the float32 weight into a scratch buffer shared
by every projection of the thread (``_dequantize``), then run oneDNN on it as
a plain dense weight (the same result, bit for bit, as the prepacked weight of
a float checkpoint holding these values: checked in the tests). The scratch
costs one weight's worth of float32, the largest projection's; rebuilding
costs a pass over the weight per prefill call (docs/serving.md, "Quantized weights", has the
measured price).

``--quantization w8a8`` keeps the same codes and quantizes the activations too
(per token, int8) for the batch sizes where integer dot products measured
faster (``MAX_W8A8_KERNEL_ROWS*``: every float32 batch, bfloat16 decode rows up
to 2 on AMX); the others run the weight-only paths above.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kvmesh.kernels import batch_invariant, native
from kvmesh.kernels.bf16_pairs import pack_pairs, packable, unpack_pairs
from kvmesh.kernels.bf16_weights import (
    exactly_bfloat16,
    pack_float_panels,
    pack_panels,
    unpack_panels,
)
from kvmesh.kernels.block_codes import BLOCK, LANES, BlockCodes, find_block_codes
from kvmesh.services.runtime.config.process import AMX_LINEAR

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
# (kernels/cpu_isa.py: avx512_bf16) the codes stay ahead of oneDNN's bf16
# matmul to 16 rows on the AVX512-BF16 EPYC (`linear_bench.py --dtype
# bfloat16`, quiet box: 1 row 6.2 vs 12.0 ms per step, 16 rows 17.1 vs 19.3,
# 20 rows 23.8 vs 23.4). Zen 4 runs 512-bit ops in two halves, so vdpbf16ps
# gained little per row over the float32 path there; AMX is unmeasured.
MAX_BLOCK_CODE_ROWS_BF16_DOT = 16
# Where the level multiplies them on AMX tiles (kernels/cpu_isa.py: amx) the
# multiplies barely grow with the rows, and the codes stay ahead to 64 rows:
# `linear_bench.py --dtype bfloat16` on the 2-core AMX Xeon (Intel(R) Xeon(R)
# Processor, AMX-BF16/INT8, AVX512-BF16; shared, load 1.5-3.8), oneDNN bf16 vs
# codes ms per step in the two quietest runs: 12 rows 30.6-34.3 vs 15.1-17.1,
# 16: 30.2-36.6 vs 16.4-18.3 (the vdpbf16ps level: 48-64), 32: 42.9-45.0 vs
# 20.3-24.0, 48: 35.5 vs 27.1 (one loaded run 39.2 vs 54.9), 64: 38.9-44.9 vs
# 34.4-42.6; codes ahead at 64 rows in 4 of 4 runs (1.06-1.29x), at 96 by
# 1.05x in the one run that tried it.
MAX_BLOCK_CODE_ROWS_BF16_AMX = 64
# A weight held only as codes pays a rebuild per call off the kernel, so the
# kernel stays ahead longer: for a 3072x576 weight on one thread of the EPYC
# (loaded box), kernel vs rebuild + oneDNN 1.5 vs 2.6 ms at 64 rows, 3.1 vs
# 4.9 at 128, even at ~192-256 (float32); in bfloat16 3.6 vs 3.9 ms at 128.
MAX_CODES_ONLY_KERNEL_ROWS = 128
# bfloat16 rows on AMX tiles stay ahead of rebuild + oneDNN bf16 far longer
# (`quant_prefill_bench.py --kernel-crossover --dtype bfloat16`, every decoder
# projection of the default model's GGUF, same AMX Xeon, loaded box): kernel
# vs rebuild ms 35 vs 302 at 64 rows, 80 vs 315 at 128, 147 vs 364 at 256,
# 333 vs 627 at 512; 768-2048 rows went either way (0.74x-1.42x).
MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX = 512
# A dense bfloat16 weight where the kernels run AMX tiles is kept plain (no
# oneDNN-packed copy) and multiplied by kernels/csrc/amx_linear.cpp up to this
# many rows; oneDNN takes larger batches over the plain weight, reordering it
# inside the call, which at 1,024+ rows cost nothing measurable. On the AMX
# Xeon (one thread, loaded box; ms per step of the 121 projections, kernel vs
# oneDNN plain vs oneDNN prepacked): 16 rows 41.9-49.2 / 70.5-85.5 /
# 52.2-65.1, 64: 97.9-105.6 / 115.9-136.6 / 66.3-79.8, 256: 310-317 /
# 330-453 / 238-374, 512: 588 / 686 / 665, 1,024: 1,886 / 1,066 / 1,102.
MAX_AMX_LINEAR_ROWS = 512
# W8A8 (--quantization w8a8): up to these many rows the activations are
# quantized to int8 and multiplied on VNNI / AMX-INT8 (kernels/csrc/
# int8_linear.cpp); larger batches run the weight-only paths above. Measured
# with `benchmarks/w8a8_bench.py` (every decoder projection of the default
# model, --quantization int8 codes, ms per pass, best of 6-15 interleaved
# rounds) on the 2-core AMX Xeon (Intel(R) Xeon(R) Processor, AMX-BF16/INT8,
# AVX512-BF16/VNNI; shared, load 2.3-3.4), 2 threads:
# float32 rows: weight-only vs W8A8 1 row 10.5 vs 11.3, 4: 16.8 vs 16.4,
# 16: 38.1 vs 28.4, 64: 408 vs 265, 128: 372 vs 201, 512: 1369 vs 791 (rebuild
# + oneDNN float32 1410), 2048: 3385 vs 2524 -> W8A8 at every size.
MAX_W8A8_KERNEL_ROWS = 1 << 30
# bfloat16 rows: weight-only runs them on AMX-BF16 tiles (and oneDNN bf16 for
# prefill), which the int32 block sums (one float multiply-add per row, output
# and 32 features) do not beat past a couple of rows: 1 row 14.6 vs 12.2, 2:
# 13.5 vs 12.2, 4: 13.5 vs 14.5, 8: 15.4 vs 22.8, 64: 73 vs 189, 512: 441-1108
# vs 591-2502, 2048: 1317-1449 (rebuild + oneDNN bf16 1937-2247) vs 2537-2574.
# Unmeasured where bf16 rows have no AMX (the avx512_bf16 level).
MAX_W8A8_KERNEL_ROWS_BF16 = 2
# bfloat16 rows where the kernels' level has vdpbf16ps but no AMX tiles
# (avx512_bf16): a copy of the weight packed in feature pairs
# (kernels/csrc/bf16_pair_linear.cpp) runs the rows from MIN_PAIR_ROWS_OVER_CODES
# (a weight with block codes: fewer rows read the codes' 1 byte per weight
# faster) or 1 (a dense weight) up to MAX_PAIR_ROWS; oneDNN takes larger
# batches. `linear_bench.py --dtype bfloat16 --rounds 9` on the 2-core
# AVX512-BF16 EPYC (Zen 4, no AMX), every projection of SmolLM2-135M, ms per
# pass, two runs, oneDNN / codes / pairs: 1 row 14.9-15.4 / 6.3 / 9.5-9.7,
# 4 rows 13.6-14.2 / 7.2-8.5 / 8.2-9.4, 8: 14.9-17.1 / 10.0-10.2 / 9.0-10.1,
# 12: 17.0 / 12.8-13.2 / 10.7-10.9, 16: 20.0-20.7 / 16.2-16.4 / 13.1-13.2,
# 32: 29.3-30.0 / 30.1-31.5 / 23.8-25.3, 64: 54.4-57.4 / 58.4-63.2 /
# 45.3-46.0; one run (7 rounds): 96: 70.4 / 87.6 / 66.9, 128: 87.9 / 114.1 /
# 86.4, 256: 164.8 / 227.5 / 170.5.
MIN_PAIR_ROWS_OVER_CODES = 8
MAX_PAIR_ROWS = 96
# float32 rows over a weight kept as bfloat16 words (kernels/csrc/
# bf16_weight_linear.cpp) up to here; larger batches widen the weight into the
# scratch buffer and run oneDNN. `benchmarks/bf16_weight_bench.py --config
# <Qwen3 family checkpoint>` (hidden 1,024, MLP 3,072, 12 layers + LM head: 49
# projections, 478 MB of words) on the 2-core Zen 2 (AVX2, quiet), ms per pass,
# float32 oneDNN-packed / words kernel / words widened + oneDNN: 1 row 49.3 /
# 27.1 / 219.5, 4: 70.4 / 31.2 / 265.3, 16: 104.5 / 68.8 / 293.1, 64: 255.0 /
# 217.2 / 432.0, 128: 466 / 423 / 652, 256: 874 / 820 / 1,092, 512: 1,745 /
# 1,694 / 1,964, 2,048: 6,908 / 7,777 / 7,040 (widening costs ~2% there).
# Where the kernel has its cache-blocked GEMM for large batches (the avx2
# level: ``native.blocked_gemm_loaded``) it takes every batch: the same
# Zen 2, 2 threads, a Qwen3 layer's three projection shapes at 1,024 rows
# ~165 GFLOP/s against ~145 for oneDNN on its own prepacked float32 copy.
MAX_BF16_WEIGHT_KERNEL_ROWS = 512


def float_panels_win(weight: torch.Tensor) -> bool:
    """Whether a float32 weight runs faster as float32 panels
    (``float_panel_linear``) than as oneDNN's packed copy: where the kernels
    have the cache-blocked GEMM (the avx2 level). Every projection shape of a
    Qwen3 and a BERT-base layer, 2 threads, the 2-core Zen 2 (quiet), ms per
    pass of the six, oneDNN-packed / panels: 1 row 4.65 / 3.22, 4: 5.94 / 3.76,
    16: 9.16 / 6.11, 64: 21.8 / 18.0, 256: 72.4 / 60.6, 1,024: 280 / 234,
    2,048: 556 / 506 (torch.mm, what F.linear runs: 299 at 1,024)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and native.blocked_gemm_loaded()
    )


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


# Rows of the identity per oneDNN call when dense_weight rebuilds a weight
# from its packed copy.
_IDENTITY_ROWS = 1024


class _Scratch(threading.local):
    buffer: torch.Tensor | None = None


_scratch = _Scratch()


def _scratch_floats(size: int) -> torch.Tensor:
    """The thread's float32 scratch buffer, at least ``size`` elements (valid
    until the next call on this thread)."""
    if _scratch.buffer is None or _scratch.buffer.numel() < size:
        # A normal tensor even when first needed under inference mode: an
        # inference tensor could not be written outside it (tests, no_grad callers).
        with torch.inference_mode(False):
            _scratch.buffer = torch.empty(size, dtype=torch.float32)
    return _scratch.buffer


def _dequantize(codes: BlockCodes) -> torch.Tensor:
    """The float32 weight ``[out_features, in_features]`` of ``codes``, rebuilt in
    the thread's scratch buffer (valid until the next call): ``code * scale``
    is exact and the sum rounds once, the kernel's fused multiply-add."""
    panels, in_features, _ = codes.codes.shape
    size = panels * LANES * in_features
    weight = _scratch_floats(size)[:size].view(panels, LANES, in_features)
    weight.copy_(codes.codes.permute(0, 2, 1))
    blocks = weight.view(panels, LANES, in_features // BLOCK, BLOCK)
    blocks.mul_(codes.scales.permute(0, 2, 1).unsqueeze(-1))
    blocks.add_(codes.offsets.permute(0, 2, 1).unsqueeze(-1))
    return weight.view(panels * LANES, in_features)[: codes.out_features]


def _dequantize_panels(codes: BlockCodes) -> torch.Tensor:
    """The float32 weight of ``codes`` as ``float_panel_linear``'s panels
    ``[panels, in_features, 16]`` (the codes' own layout), rebuilt in the
    thread's scratch buffer with ``_dequantize``'s arithmetic: the same values."""
    panels, in_features, lanes = codes.codes.shape
    size = panels * in_features * lanes
    weight = _scratch_floats(size)[:size].view(panels, in_features, lanes)
    weight.copy_(codes.codes)
    blocks = weight.view(panels, in_features // BLOCK, BLOCK, lanes)
    blocks.mul_(codes.scales.unsqueeze(2))
    blocks.add_(codes.offsets.unsqueeze(2))
    return weight


def amx_linear_takes(weight: torch.Tensor) -> bool:
    """Whether kernels/csrc/amx_linear.cpp can multiply by ``weight`` here."""
    out_features, in_features = weight.shape
    return (
        AMX_LINEAR.get()
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and in_features % 32 == 0
        and out_features >= 16
        and native.amx_tiles_loaded()  # None level (kernels unavailable) -> False
    )


def pair_kernel_loaded() -> bool:
    """Whether bfloat16 decode rows run ``bf16_pair_linear``: the loaded
    kernels' level multiplies bfloat16 pairs with vdpbf16ps and has no AMX
    tiles (where it has, the codes and amx_linear run those rows on tiles)."""
    return _kernel_takes_bf16() and not native.amx_tiles_loaded()


def _kernel_takes_bf16() -> bool:
    """Whether the loaded kernels' level multiplies bfloat16 rows natively."""
    level = native.loaded_level()
    return level is not None and level.bf16_dot_products


class PackedLinear:
    """A frozen weight (and bias) prepared once for inference, computing in
    ``dtype`` (default: the weight's; a float32 weight may run in bfloat16)."""

    __slots__ = (
        "_amx_plain",
        "_bf16_panels",
        "_bias",
        "_codes",
        "_codes_on_amx",
        "_codes_take_bf16",
        "_dtype",
        "_float_panels",
        "_int8_activations",
        "_kernel",
        "_onednn",
        "_packed",
        "_pairs",
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
        dtype = self._dtype = dtype or weight.dtype
        self._onednn = use_onednn
        self._bias = None if bias is None else bias.to(dtype)
        self._codes: BlockCodes | None = None
        self._kernel = (
            use_block_codes and weight.device.type == "cpu" and native.unavailable_reason() is None
        )
        if self._kernel:
            self._codes = find_block_codes(weight)  # float32 weights only
        self._codes_take_bf16 = self._codes is not None and _kernel_takes_bf16()
        self._codes_on_amx = self._codes_take_bf16 and native.amx_tiles_loaded()
        self._int8_activations = False
        # Packed from the float32 weight: the same bfloat16 words as the codes'
        # rebuild (their values are this weight's exactly).
        runs_pairs = self._kernel and dtype == torch.bfloat16 and pair_kernel_loaded()
        self._pairs = pack_pairs(weight) if runs_pairs and packable(weight) else None
        # A bfloat16 checkpoint's weight computing in float32: its bfloat16 words
        # are all of it (exact), half the bytes for decode rows to read.
        self._bf16_panels: torch.Tensor | None = None
        self._float_panels: torch.Tensor | None = None
        if (
            self._kernel
            and self._codes is None
            and dtype == torch.float32
            and weight.dim() == 2
            and exactly_bfloat16(weight)
        ):
            self._bf16_panels = pack_panels(weight)
            self._amx_plain = False
            self._packed = None
            self.weight = None
            return
        weight = weight.to(dtype)
        # A plain bfloat16 weight for amx_linear (MAX_AMX_LINEAR_ROWS) and oneDNN
        # above, instead of oneDNN's packed copy; with block codes too, for the
        # batches past the codes kernel's rows. Every decoder projection shape of
        # SmolLM2-135M, one process, best of 12 interleaved rounds on the 2-core
        # AMX Xeon: 256 rows 2.86 ms (amx_linear) vs 3.78 (packed), 512 8.30 vs
        # 11.10, 1,024 15.35 (oneDNN on the plain weight) vs 16.19, 2,048 23.67 vs 27.07.
        self._amx_plain = use_onednn and amx_linear_takes(weight) and onednn_available(weight)
        if self._amx_plain:
            self._packed = None
            self.weight = weight.contiguous()
        elif use_onednn and dtype == torch.float32 and float_panels_win(weight):
            # Instead of oneDNN's copy: the same bytes, faster at every batch size there.
            self._float_panels = pack_float_panels(weight)
            self._packed = None
            self.weight = None
        elif use_onednn and onednn_available(weight):
            self._packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _BATCH_SIZE_HINT
            )
            self.weight = None  # the packed copy replaces it: no second copy in memory
        else:
            self._packed = None
            self.weight = weight

    @classmethod
    def from_codes(
        cls,
        codes: BlockCodes,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        use_kernel: bool = True,
        use_onednn: bool = True,
        int8_activations: bool = False,
    ) -> PackedLinear:
        """A quantized projection holding only its codes (no dense copy):
        ``use_kernel`` runs small batches on the C++ kernel when it loads;
        everything else rebuilds the weight per call and multiplies with
        oneDNN (``use_onednn``) or F.linear (CPU only). ``int8_activations``
        (W8A8): up to ``MAX_W8A8_KERNEL_ROWS`` float32 rows
        (``_BF16``: bfloat16) are quantized per token to int8 and multiplied
        on integer dot products (the kernel must load)."""
        self = cls.__new__(cls)
        self._onednn = use_onednn
        self.out_features, self.in_features = codes.out_features, codes.codes.shape[1]
        self._dtype = dtype
        self._bias = None if bias is None else bias.to(dtype)
        self._codes = codes
        self._kernel = use_kernel and native.unavailable_reason() is None
        self._codes_take_bf16 = self._kernel and _kernel_takes_bf16()
        self._codes_on_amx = self._codes_take_bf16 and native.amx_tiles_loaded()
        self._amx_plain = False
        self._bf16_panels = None
        self._float_panels = None
        self._pairs = None  # only the codes are kept: that is the point of them
        self._int8_activations = int8_activations and self._kernel
        if int8_activations and not self._kernel:
            reason = native.unavailable_reason() or "use_kernel=False"
            raise ValueError(f"W8A8 needs the C++ CPU kernels: {reason}")
        self._packed = None
        self.weight = None
        return self

    @property
    def codes(self) -> BlockCodes | None:
        return self._codes

    @property
    def uses_block_codes(self) -> bool:
        return self._codes is not None and self._kernel

    @property
    def keeps_bf16_words(self) -> bool:
        """Whether a float32 weight is kept as its bfloat16 words (all its values are bfloat16)."""
        return self._bf16_panels is not None

    @property
    def codes_only(self) -> bool:
        """Whether the codes are all there is of this weight (a quantized one)."""
        return (
            self._codes is not None
            and self._packed is None
            and self.weight is None
            and self._float_panels is None
        )

    @property
    def resident_bytes(self) -> int:
        """Bytes this projection keeps for its weight (codes, packed or dense copy)."""
        total = 0 if self._codes is None else self._codes.nbytes
        kept = (self._packed, self._pairs, self._bf16_panels, self._float_panels, self.weight)
        for tensor in kept:
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense [out_features, in_features] tensor, rebuilt
        exactly from what this projection keeps (its parameter need not stay
        beside it, and packing again starts from this): the plain weight; else
        the block codes, in float32 (the very values they were found in); else
        the bfloat16 pairs, word for word; else oneDNN's packed copy, multiplied
        by the identity (each output is one weight times 1.0 plus zeros: exact
        in its own dtype)."""
        if self.weight is not None:
            return self.weight
        if self._codes is not None:
            return _dequantize(self._codes).clone()
        for panels in (self._bf16_panels, self._float_panels):
            if panels is not None:
                return unpack_panels(panels, self.out_features)
        if self._pairs is not None:
            return unpack_pairs(self._pairs, self.out_features)
        assert self._packed is not None
        transposed = torch.empty(self.in_features, self.out_features, dtype=self._dtype)
        # The identity a slice of rows at a time: rows x in_features, not in_features^2.
        for first in range(0, self.in_features, _IDENTITY_ROWS):
            rows = min(_IDENTITY_ROWS, self.in_features - first)
            identity = torch.zeros(rows, self.in_features, dtype=self._dtype)
            identity[:, first : first + rows].fill_diagonal_(1.0)
            transposed[first : first + rows] = torch.ops.mkldnn._linear_pointwise(
                identity, self._packed, None, "none", [], ""
            )
        return transposed.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.enabled() and x.dim() == 2:
            return self._batch_invariant(x)
        if self._int8_activations and _w8a8_fits(x):
            return self._w8a8(x)
        if self._bf16_panels is not None:
            return self._bf16_words(x)
        codes = self._codes
        if self._pairs is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            min_rows = 1 if codes is None else MIN_PAIR_ROWS_OVER_CODES
            if min_rows <= x.shape[0] <= MAX_PAIR_ROWS:
                return torch.ops.kvmesh.bf16_pair_linear(
                    x.contiguous(), self._pairs, self._bias, self.out_features
                )
        on_amx = self._codes_on_amx and x.dtype == torch.bfloat16
        if self.codes_only:
            max_rows = MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX if on_amx else MAX_CODES_ONLY_KERNEL_ROWS
        elif x.dtype == torch.float32:
            max_rows = MAX_BLOCK_CODE_ROWS
        elif on_amx:
            max_rows = MAX_BLOCK_CODE_ROWS_BF16_AMX
        elif self._codes_take_bf16:
            max_rows = MAX_BLOCK_CODE_ROWS_BF16_DOT
        else:
            max_rows = MAX_BLOCK_CODE_ROWS_BF16
        if self._kernel and codes is not None and x.dim() == 2 and x.shape[0] <= max_rows:
            return self._block_codes(x)
        return self._without_codes(x)

    def _block_codes(self, x: torch.Tensor) -> torch.Tensor:
        """The block-code kernel (any number of rows)."""
        codes = self._codes
        assert codes is not None
        # bfloat16 rows go in as they are where the kernel multiplies them
        # natively (bf16 out), else as float32 (float32 out, rounded once).
        x_in = x if self._codes_take_bf16 else x.float()
        y = torch.ops.kvmesh.block_code_linear(
            x_in.contiguous(), codes.codes, codes.scales, codes.offsets, codes.out_features
        )
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self._bias is None else y.add_(self._bias)

    def _batch_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Batch-invariant mode (kernels/batch_invariant.py): kernels whose
        per-row sums do not change with the number of rows."""
        if self._int8_activations:
            return self._w8a8(x)  # per-token int8, exact integer sums: any batch
        if self._bf16_panels is not None and x.dtype == torch.float32:
            return self._bf16_kernel(x.contiguous())  # a row's sums ignore the others
        if self._float_panels is not None and self._codes is None:
            return self._float_panel_kernel(x)  # the same: each row's own chain
        if self._kernel and self._codes is not None:
            return self._block_codes(x)
        return batch_invariant.tiled_rows(x.contiguous(), self._without_codes)

    def _bf16_words(self, x: torch.Tensor) -> torch.Tensor:
        """A weight kept as bfloat16 words: the kernel for decode-sized batches
        (every batch where it has its blocked GEMM), the weight widened into the
        scratch buffer and oneDNN above."""
        panels = self._bf16_panels
        assert panels is not None
        on_kernel = x.shape[0] <= MAX_BF16_WEIGHT_KERNEL_ROWS or native.blocked_gemm_loaded()
        if x.dim() == 2 and x.dtype == torch.float32 and on_kernel:
            return self._bf16_kernel(x.contiguous())
        weight = unpack_panels(
            panels, self.out_features, _scratch_floats(self.out_features * self.in_features)
        )
        if x.dtype != torch.float32:
            weight = weight.to(x.dtype)
        return self._rebuilt_linear(x, weight)

    def _rebuilt_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x times a weight rebuilt for this call (codes or bfloat16 words): oneDNN
        on the plain dense weight (it reorders inside the call), else F.linear."""
        if self._onednn and onednn_available(weight) and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), weight, self._bias, "none", [], ""
            )
        return F.linear(x, weight, self._bias)

    def _bf16_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvmesh.bf16_weight_linear(
            x, self._bf16_panels, self._bias, self.out_features
        )

    def _float_panel_kernel(self, x: torch.Tensor) -> torch.Tensor:
        panels = self._float_panels
        assert panels is not None
        if x.dim() == 2 and x.dtype == torch.float32:
            return torch.ops.kvmesh.float_panel_linear(
                x.contiguous(), panels, self._bias, self.out_features
            )
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.ops.kvmesh.float_panel_linear(rows, panels, self._bias, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _without_codes(self, x: torch.Tensor) -> torch.Tensor:
        """The paths past the codes kernel: float32 panels, oneDNN, amx_linear, F.linear."""
        if self._float_panels is not None:
            return self._float_panel_kernel(x)
        codes = self._codes
        if self._packed is None and self.weight is None:
            assert codes is not None
            if x.dtype == torch.float32 and x.dim() == 2 and native.blocked_gemm_loaded():
                # The codes' own layout is the panels': rebuilt in place, no transpose.
                return torch.ops.kvmesh.float_panel_linear(
                    x.contiguous(), _dequantize_panels(codes), self._bias, self.out_features
                )
            weight = _dequantize(codes)
            if self._dtype != torch.float32:
                weight = weight.to(self._dtype)
            return self._rebuilt_linear(x, weight)
        if self._amx_plain and x.dim() == 2:
            if x.shape[0] <= MAX_AMX_LINEAR_ROWS:
                return torch.ops.kvmesh.amx_linear(x.contiguous(), self.weight, self._bias)
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self._bias, "none", [], ""
            )
        if self._packed is None:
            return F.linear(x, self.weight, self._bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, self._bias, "none", [], ""
        )

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 (kernels/csrc/int8_linear.cpp): int8 activations per token times the codes."""
        codes = self._codes
        assert codes is not None
        y = torch.ops.kvmesh.int8_block_code_linear(
            x.contiguous(), codes.codes, codes.scales, codes.offsets, codes.out_features
        )
        return y if self._bias is None else y.add_(self._bias)


def _w8a8_fits(x: torch.Tensor) -> bool:
    """Whether the W8A8 kernel takes ``x`` (else the weight-only paths run)."""
    if x.dim() != 2:
        return False
    if x.dtype == torch.float32:
        return x.shape[0] <= MAX_W8A8_KERNEL_ROWS
    return x.dtype == torch.bfloat16 and x.shape[0] <= MAX_W8A8_KERNEL_ROWS_BF16
