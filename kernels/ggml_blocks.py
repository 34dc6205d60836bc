"""A GGUF file's quantized tensor kept as the file's own blocks, row by row.

Q4_K, Q5_K and Q6_K (the K-quants of Q4_K_M / Q5_K_M / Q6_K files) pack 256
weights per super-block, Q5_0 and Q5_1 (llama.cpp's fallback for rows whose
width is no multiple of 256) 32 per block. Their weights are never expanded
to a dense float copy: ``GGMLRows`` holds the bytes, uint8 ``[rows, K /
block_weights * block_bytes]``, and kernels/csrc/ggml_block_linear.cpp
multiplies by them (decode) or rebuilds a tile of rows at a time (prefill, an
embedding lookup). A fused projection whose pieces have different types
(q and k in Q4_K, v in Q6_K) is one ``GGMLRows`` of several *segments*, each
one type, multiplied in one kernel call.

The rebuilt float32 values are those of the ``gguf`` package's
``dequantize`` (and llama.cpp's), bit for bit: tests/kernels check it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvmesh.kernels import native

Q = GGMLQuantizationType
# (weights, bytes) per block of every type the kernel reads.
BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.Q4_0: (32, 18),
    Q.Q4_1: (32, 20),
    Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24),
    Q.Q8_0: (32, 34),
    Q.Q4_K: (256, 144),
    Q.Q5_K: (256, 176),
    Q.Q6_K: (256, 210),
}
# From this many rows of x, ``linear_int8`` runs ggml_q8_panel.cpp (codes
# unpacked once per call into an L1 panel, 4 x 2 register tiles); below it,
# ggml_q8_linear.cpp (codes unpacked in registers, once per 4 rows of x, which
# up to 4 rows is once per call as well). benchmarks/ggml_q8_bench.py on the
# 2-core Zen 2 EPYC (AVX2), one Q4_K_M layer of the default model, 1 thread,
# ms of CPU time rows / panel: 4 rows 0.990 / 1.046, 5: 1.341 / 1.234,
# 8: 1.851 / 1.648, 16: 3.735 / 2.949, 32: 7.420 / 5.575 (docs/performance.md,
# "Decode batches on GGUF blocks"). On the avx2 level the projection
# (worker/models/ggml_linear.py) sends batches from FLOAT_GEMM_MIN_ROWS_W8A8
# rows to ``float_gemm`` instead, so the panel serves 5-9 rows there.
PANEL_MIN_ROWS = 5
# Q8_0 codes are plain bytes that the row kernel reads as they are: the panel,
# which copies them (and their signs), ran at 0.59-1.05x the row kernel's speed
# at 1-64 rows of x (the same benchmark, Q8_0 layer).
ROW_KERNEL_ONLY = frozenset({Q.Q8_0})


@dataclass(frozen=True)
class Segment:
    """Rows of one GGML type: ``blocks`` uint8 [rows, K / weights * bytes]."""

    kind: GGMLQuantizationType
    blocks: torch.Tensor

    def dequantize(self, in_features: int) -> torch.Tensor:
        if native.unavailable_reason() is None:
            return torch.ops.kvmesh.ggml_dequantize(self.blocks, int(self.kind), in_features)
        dense = gguf_dequantize(self.blocks.numpy(), self.kind)
        return torch.from_numpy(np.array(dense, dtype=np.float32)).view(-1, in_features)


@dataclass(frozen=True)
class GGMLRows:
    """Weights ``[out_features, in_features]`` as GGUF blocks, in row segments."""

    segments: tuple[Segment, ...]
    in_features: int

    @staticmethod
    def from_file(data: np.ndarray, kind: GGMLQuantizationType, rows: int, cols: int) -> GGMLRows:
        """A tensor's raw bytes as the gguf reader gives them (one row per row)."""
        weights, nbytes = BLOCK_FORMATS[kind]
        if cols % weights:
            raise ValueError(f"{kind.name} rows of {cols} weights are not whole blocks")
        raw = np.ascontiguousarray(data).reshape(rows, cols // weights * nbytes)
        return GGMLRows((Segment(kind, torch.from_numpy(raw.copy())),), cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(s.blocks.shape[0] for s in self.segments), self.in_features))

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)

    @property
    def kinds(self) -> tuple[GGMLQuantizationType, ...]:
        return tuple(s.kind for s in self.segments)

    def _only(self) -> Segment:
        if len(self.segments) != 1:
            raise ValueError("rows of a multi-type GGUF weight are sliced before joining")
        return self.segments[0]

    def __getitem__(self, key: slice | torch.Tensor | tuple[slice, slice]) -> GGMLRows:
        """Rows (``w[rows]``), or whole blocks of columns (``w[:, cols]``)."""
        segment = self._only()
        if not isinstance(key, tuple):
            return GGMLRows(
                (Segment(segment.kind, segment.blocks[key].contiguous()),), self.in_features
            )
        rows, cols = key
        weights, nbytes = BLOCK_FORMATS[segment.kind]
        start, stop, step = cols.indices(self.in_features)
        if step != 1 or start % weights or stop % weights:
            raise ValueError(f"columns {cols} do not fall on {segment.kind.name} blocks")
        byte_cols = slice(start // weights * nbytes, stop // weights * nbytes)
        blocks = segment.blocks[rows, byte_cols].contiguous()
        return GGMLRows((Segment(segment.kind, blocks),), stop - start)

    @staticmethod
    def cat(parts: list[GGMLRows]) -> GGMLRows:
        """Rows of ``parts`` in order; neighbours of one type merge into one segment."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUF pieces of one weight differ in width")
        segments: list[Segment] = []
        for segment in (s for p in parts for s in p.segments):
            if segments and segments[-1].kind == segment.kind:
                joined = torch.cat([segments[-1].blocks, segment.blocks])
                segments[-1] = Segment(segment.kind, joined)
            else:
                segments.append(segment)
        return GGMLRows(tuple(segments), parts[0].in_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` (an embedding lookup without a dense table)."""
        segment = self._only()
        flat = ids.reshape(-1)
        rows = Segment(segment.kind, segment.blocks.index_select(0, flat)).dequantize(
            self.in_features
        )
        return rows.view(*ids.shape, self.in_features)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """The float32 weights of rows [start, stop) (a prefill tile)."""
        pieces = []
        first = 0
        for segment in self.segments:
            rows = segment.blocks.shape[0]
            lo, hi = max(start, first), min(stop, first + rows)
            if lo < hi:
                part = Segment(segment.kind, segment.blocks[lo - first : hi - first])
                pieces.append(part.dequantize(self.in_features))
            first += rows
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (mixing with a dense part of a fused weight, tests)."""
        return self.dequantize_rows(0, self.shape[0])

    @functools.cached_property
    def kernel_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """The kernels' block tensors and ggml type numbers, listed once: a
        decode step calls a kernel per projection, ~120 times."""
        return [s.blocks for s in self.segments], [int(s.kind) for s in self.segments]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in_features] float32 @ Wᵀ`` on the C++ kernel over the blocks."""
        return torch.ops.kvmesh.ggml_linear(x, *self.kernel_args)

    def float_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in_features] float32 @ Wᵀ`` with each k slice of 16-row panels
        dequantized once into float32 panels for the blocked GEMM
        (kernels/csrc/ggml_float_gemm.cpp): the same weights as ``dequantize``, one
        fused multiply-add chain over k per output (bitwise independent of M)."""
        return torch.ops.kvmesh.ggml_float_gemm(x, *self.kernel_args)

    def linear_int8(self, x: torch.Tensor) -> torch.Tensor:
        """The same with ``x`` quantized to int8 per 32 features, integer dot products
        (kernels/csrc/ggml_q8_linear.cpp; ggml_q8_row.cpp for one row, ggml_q8_panel.cpp
        from ``PANEL_MIN_ROWS`` rows; their reference: kernels/ggml_q8_reference.py)."""
        blocks, kinds = self.kernel_args
        if x.shape[0] == 1:
            # A batch-1 decode step: the loops written for one row of x
            # (kernels/csrc/ggml_q8_row.cpp), the same arithmetic.
            return torch.ops.kvmesh.ggml_linear_q8_row(x, blocks, kinds)
        panel = x.shape[0] >= PANEL_MIN_ROWS and not ROW_KERNEL_ONLY.issuperset(self.kinds)
        op = torch.ops.kvmesh.ggml_linear_q8_panel if panel else torch.ops.kvmesh.ggml_linear_q8
        return op(x, blocks, kinds)
