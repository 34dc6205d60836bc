"""GGUF blocks times int8 activations (--quantization w8a8 on a GGUF file's blocks).

kernels/csrc/ggml_q8_linear.cpp (the row kernel) and ggml_q8_panel.cpp (the
panel kernel for decode batches) must compute kernels/ggml_q8_reference.py's
arithmetic (activations quantized per 32 features, the gguf package's
dequantized weights, float64) within float32 rounding for every block type
and batch size, and must differ from the float-activation kernel by the
activation rounding (so a kernel that skipped the quantization fails).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvmesh.kernels import native
from kvmesh.kernels.ggml_blocks import (
    BLOCK_FORMATS,
    PANEL_MIN_ROWS,
    ROW_KERNEL_ONLY,
    GGMLRows,
    Segment,
)
from kvmesh.kernels.ggml_q8_reference import ggml_q8_reference, quantize_runs
from kvmesh.worker.models import ggml_linear
from kvmesh.worker.models.ggml_linear import MAX_GGML_Q8_KERNEL_ROWS, GGMLLinear

from .test_kernels_ggml_blocks import _random_blocks

needs_kernels = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=str(native.unavailable_reason())
)
# Relative to sum |w| |x| of each output: float32 sums of a few hundred terms
# stay near 1e-7; int8 activations move outputs by ~1e-3 (half a step of 127).
KERNEL_TOLERANCE = 1e-6


def _rows(kind, out_features: int, in_features: int, seed: int) -> GGMLRows:
    raw = _random_blocks(kind, out_features, in_features, seed)
    return GGMLRows((Segment(kind, torch.from_numpy(raw)),), in_features)


def _relative_error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    return float(((got.double() - want) / scale).abs().max())


def test_activations_quantize_per_32_features_with_ties_to_even() -> None:
    x = torch.zeros(1, 64)
    x[0, 0] = 127.0  # scale 1: the other values are their own codes
    x[0, 1:4] = torch.tensor([0.5, 1.5, -2.5])
    x[0, 32] = -3.0  # the second block: its own scale 3 / 127
    q, scales = quantize_runs(x)
    assert q[0, :4].tolist() == [127.0, 0.0, 2.0, -2.0]
    assert q[0, 32] == -127.0
    assert scales[0].tolist() == pytest.approx([1.0, 3.0 / 127])


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
@pytest.mark.parametrize("batch", [1, 3, 4, 6, 17])
def test_kernel_is_the_int8_reference(kind, batch: int) -> None:
    rows = _rows(kind, 37, 512, seed=int(kind))
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 512, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    x[-1, 40] = 30.0  # an outlier owning its block's scale
    weights = rows.dequantize().double()
    scale = x.double().abs() @ weights.abs().T
    # The row kernel itself at every batch (linear_int8 sends 2 rows and more to the panel).
    got = torch.ops.kvmesh.ggml_linear_q8(x, [rows.segments[0].blocks], [int(kind)])
    assert got.shape == (batch, 37)
    want = ggml_q8_reference(x, rows)
    assert _relative_error(got, want, scale) < KERNEL_TOLERANCE
    # The activations really were quantized: float ones are this far off.
    assert _relative_error(rows.linear(x), want, scale) > 100 * KERNEL_TOLERANCE


@needs_kernels
def test_mixed_segments_in_one_call() -> None:
    kinds = [k for k in BLOCK_FORMATS if BLOCK_FORMATS[k][0] == 256] + [next(iter(BLOCK_FORMATS))]
    rows = GGMLRows.cat([_rows(kind, 9, 768, seed=i) for i, kind in enumerate(kinds)])
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(7))
    scale = x.double().abs() @ rows.dequantize().double().abs().T
    got = rows.linear_int8(x)
    assert _relative_error(got, ggml_q8_reference(x, rows), scale) < KERNEL_TOLERANCE


@needs_kernels
def test_projection_takes_int8_activations_only_when_asked() -> None:
    rows = _rows(next(iter(BLOCK_FORMATS)), 16, 256, seed=1)
    # Below FLOAT_GEMM_MIN_ROWS: both run their kernels over the blocks.
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    w8a8 = GGMLLinear(rows, None, torch.float32, int8_activations=True)
    exact = GGMLLinear(rows, None, torch.float32)
    assert torch.equal(w8a8(x), rows.linear_int8(x))
    assert torch.equal(exact(x), rows.linear(x))


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
@pytest.mark.parametrize("batch", [2, 5, 8, 33])
def test_panel_kernel_is_the_int8_reference(kind, batch: int) -> None:
    # 544 = 17 runs of 32: a legacy row whose 16-weight offsets do not fill
    # whole vectors (the panel's padding); K-quant rows are whole super-blocks.
    width = 544 if BLOCK_FORMATS[kind][0] == 32 else 768
    rows = _rows(kind, 37, width, seed=int(kind) + batch)  # 37: tails of every tile
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, width, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    x[-1, 40] = 30.0  # an outlier owning its block's scale
    scale = x.double().abs() @ rows.dequantize().double().abs().T
    blocks, kinds = [s.blocks for s in rows.segments], [int(s.kind) for s in rows.segments]
    got = torch.ops.kvmesh.ggml_linear_q8_panel(x, blocks, kinds)
    assert got.shape == (batch, 37)
    want = ggml_q8_reference(x, rows)
    assert _relative_error(got, want, scale) < KERNEL_TOLERANCE
    assert _relative_error(rows.linear(x), want, scale) > 100 * KERNEL_TOLERANCE


@needs_kernels
def test_panel_kernel_takes_mixed_segments() -> None:
    kinds = [k for k in BLOCK_FORMATS if BLOCK_FORMATS[k][0] == 256] + [Q.Q8_0, Q.Q5_0]
    rows = GGMLRows.cat([_rows(kind, 11, 512, seed=i) for i, kind in enumerate(kinds)])
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(11))
    scale = x.double().abs() @ rows.dequantize().double().abs().T
    got = torch.ops.kvmesh.ggml_linear_q8_panel(
        x, [s.blocks for s in rows.segments], [int(s.kind) for s in rows.segments]
    )
    assert _relative_error(got, ggml_q8_reference(x, rows), scale) < KERNEL_TOLERANCE


@needs_kernels
@pytest.mark.parametrize(
    ("kind", "batch"),
    [(Q.Q4_K, b) for b in sorted({1, PANEL_MIN_ROWS - 1, PANEL_MIN_ROWS, 40})] + [(Q.Q8_0, 16)],
)
def test_int8_rows_dispatch_by_batch_and_type(kind, batch: int) -> None:
    rows = _rows(kind, 16, 256, seed=5)
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(batch))
    blocks, kinds = [rows.segments[0].blocks], [int(kind)]
    panel = batch >= PANEL_MIN_ROWS and kind not in ROW_KERNEL_ONLY
    op = torch.ops.kvmesh.ggml_linear_q8_panel if panel else torch.ops.kvmesh.ggml_linear_q8
    if batch == 1:
        op = torch.ops.kvmesh.ggml_linear_q8_row  # one row: its own loops (ggml_q8_row.cpp)
    assert torch.equal(rows.linear_int8(x), op(x, blocks, kinds))


@needs_kernels
def test_w8a8_projection_takes_float_tiles_past_its_kernel_bound(monkeypatch) -> None:
    rows = _rows(Q.Q4_K, 16, 256, seed=6)
    w8a8 = GGMLLinear(rows, None, torch.float32, int8_activations=True)
    # Where the blocked GEMM is built, batches from FLOAT_GEMM_MIN_ROWS_W8A8 run
    # it instead (tests/kernels/test_kernels_ggml_float_gemm.py): the bound
    # below is that of the other levels.
    monkeypatch.setattr(ggml_linear, "FLOAT_GEMM_MIN_ROWS_W8A8", 1 << 30)
    x = torch.randn(MAX_GGML_Q8_KERNEL_ROWS + 1, 256, generator=torch.Generator().manual_seed(6))
    assert torch.equal(w8a8(x), w8a8.linear_by_tiles(x))
    assert torch.equal(w8a8(x[:-1]), rows.linear_int8(x[:-1]))
