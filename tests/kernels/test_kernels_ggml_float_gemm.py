"""GGUF blocks dequantized a k slice at a time into float32 panels for the
blocked GEMM (kernels/csrc/ggml_float_gemm.cpp) and the projection's dispatch
to it (worker/models/ggml_linear.py).

The weights must be the ``gguf`` package's dequantization, and each output one
chain of fused multiply-adds over k: the float64 product of those weights
within float32 rounding, bitwise the same row whatever the other rows of the
call, and bitwise ``float_panel_linear`` over the same weights as float32 panels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvmesh.kernels import native
from kvmesh.kernels.bf16_weights import pack_float_panels
from kvmesh.kernels.ggml_blocks import BLOCK_FORMATS, GGMLRows, Segment
from kvmesh.worker.models.ggml_linear import (
    FLOAT_GEMM_MIN_ROWS,
    FLOAT_GEMM_MIN_ROWS_W8A8,
    GGMLLinear,
)

from .test_kernels_ggml_blocks import _random_blocks

needs_kernels = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=str(native.unavailable_reason())
)
needs_blocked_gemm = pytest.mark.skipif(
    native.unavailable_reason() is not None or not native.blocked_gemm_loaded(),
    reason="the projection dispatches to the float GEMM on the avx2 level only",
)
# 37 outputs: two full panels and a ragged one; 1,280 features: three k slices
# of the GEMM (512 + 512 + 256: whole blocks of 256), so later slices resume
# from the partial sums in y.
OUT, K = 37, 1280


def _segment(kind: Q, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, their float32 weights as gguf dequantizes them)."""
    raw = _random_blocks(kind, rows, K, seed)
    weight = np.array(dequantize(raw, kind), dtype=np.float32).reshape(rows, K)
    return torch.from_numpy(raw), torch.from_numpy(weight)


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
def test_float_gemm_is_gguf_weights_times_x(kind: Q) -> None:
    blocks, weight = _segment(kind, OUT, seed=int(kind))
    panels = pack_float_panels(weight)
    x = torch.randn(57, K, generator=torch.Generator().manual_seed(int(kind)))
    whole = torch.ops.kvmesh.ggml_float_gemm(x, [blocks], [int(kind)])
    # Relative to sum |x| |w| per output: float32 chains of 1,280 terms stay near 1e-7.
    want = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    assert float(((whole.double() - want) / scale).abs().max()) < 1e-6
    for rows in (1, 5, 8, 16, 40):
        part = torch.ops.kvmesh.ggml_float_gemm(x[:rows], [blocks], [int(kind)])
        # A row's chain is its own: the same bits at every batch size ...
        assert torch.equal(part, whole[:rows]), rows
        # ... and those of the float32 panels' kernel over the same weights.
        assert torch.equal(
            part, torch.ops.kvmesh.float_panel_linear(x[:rows], panels, None, OUT)
        ), rows


@needs_kernels
def test_float_gemm_runs_mixed_segments_in_one_call() -> None:
    """A Q4_K_M layer's fused projection: ragged segments of three types."""
    pieces = [(Q.Q5_0, 20), (Q.Q8_0, 7), (Q.Q6_K, 33)]
    segments = [_segment(kind, rows, seed) for seed, (kind, rows) in enumerate(pieces)]
    blocks, kinds = [b for b, _ in segments], [int(kind) for kind, _ in pieces]
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(3)) * 3
    got = torch.ops.kvmesh.ggml_float_gemm(x, blocks, kinds)
    assert got.shape == (11, 60)
    want = torch.cat(
        [torch.ops.kvmesh.ggml_float_gemm(x, [b], [k]) for b, k in zip(blocks, kinds, strict=True)],
        dim=1,
    )
    assert torch.equal(got, want)
    # A strided x (a view of a wider buffer) reads the same values.
    wide = torch.zeros(11, K + 32)
    wide[:, :K] = x
    assert torch.equal(torch.ops.kvmesh.ggml_float_gemm(wide[:, :K], blocks, kinds), got)
    with pytest.raises(RuntimeError, match="ggml_float_gemm"):
        torch.ops.kvmesh.ggml_float_gemm(x[:, :256], blocks, kinds)


@needs_blocked_gemm
@pytest.mark.parametrize("int8_activations", [False, True], ids=["float", "w8a8"])
def test_projection_dispatches_to_float_gemm_by_rows(int8_activations: bool) -> None:
    blocks, _ = _segment(Q.Q4_K, OUT, seed=9)
    rows = GGMLRows((Segment(Q.Q4_K, blocks),), K)
    bias = torch.randn(OUT)
    projection = GGMLLinear(rows, bias, torch.float32, int8_activations=int8_activations)
    bound = FLOAT_GEMM_MIN_ROWS_W8A8 if int8_activations else FLOAT_GEMM_MIN_ROWS
    x = torch.randn(bound, K, generator=torch.Generator().manual_seed(9))
    assert torch.equal(projection(x), rows.float_gemm(x) + bias)
    below = rows.linear_int8(x[:-1]) if int8_activations else rows.linear(x[:-1])
    assert torch.equal(projection(x[:-1]), below + bias)
    # Prefill chunks too, with their leading dimensions, instead of the tiles.
    chunk = torch.randn(2, 150, K, generator=torch.Generator().manual_seed(10))
    got = projection(chunk)
    assert got.shape == (2, 150, OUT)
    assert torch.equal(got.view(-1, OUT), rows.float_gemm(chunk.view(-1, K)) + bias)
    torch.testing.assert_close(got, projection.linear_by_tiles(chunk) + bias, rtol=1e-5, atol=1e-4)
