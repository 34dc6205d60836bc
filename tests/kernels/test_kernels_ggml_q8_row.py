"""The batch-1 loops of the int8-activation GGUF kernel (kernels/csrc/ggml_q8_row.cpp).

One row of x (a decode step at batch 1) runs its own loops; they must compute
kernels/ggml_q8_reference.py's arithmetic like the general kernel
(ggml_q8_linear.cpp) does, for every block type, for block counts that do not
fill the loops' unrolling, across type segments and split over threads.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.ggml_blocks import BLOCK_FORMATS, GGMLRows, Segment
from kvmesh.kernels.ggml_q8_reference import ggml_q8_reference

from .test_kernels_ggml_blocks import _random_blocks
from .test_kernels_ggml_q8 import KERNEL_TOLERANCE

needs_kernels = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=str(native.unavailable_reason())
)


def _rows(kind, out_features: int, in_features: int, seed: int) -> GGMLRows:
    raw = _random_blocks(kind, out_features, in_features, seed)
    return GGMLRows((Segment(kind, torch.from_numpy(raw)),), in_features)


def _row_op(x: torch.Tensor, rows: GGMLRows) -> torch.Tensor:
    return torch.ops.kvmesh.ggml_linear_q8_row(
        x, [s.blocks for s in rows.segments], [int(s.kind) for s in rows.segments]
    )


def _relative_error(got: torch.Tensor, x: torch.Tensor, rows: GGMLRows) -> float:
    scale = x.double().abs() @ rows.dequantize().double().abs().T
    return float(((got.double() - ggml_q8_reference(x, rows)) / scale).abs().max())


def _x(in_features: int, seed: int) -> torch.Tensor:
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    x[0, 40] = 30.0  # an outlier owning its block's scale
    return x


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
def test_one_row_is_the_int8_reference(kind) -> None:
    weights = BLOCK_FORMATS[kind][0]
    # An odd number of blocks (the loops alternate two accumulators), and more than one.
    for blocks in (3, 5) if weights == 256 else (17, 48):
        rows = _rows(kind, 21, blocks * weights, seed=int(kind) + blocks)
        x = _x(blocks * weights, seed=blocks)
        got = _row_op(x, rows)
        assert got.shape == (1, 21)
        assert _relative_error(got, x, rows) < KERNEL_TOLERANCE
        # The general kernel computes the same sums.
        assert _relative_error(rows.linear_int8(torch.cat([x, x]))[:1], x, rows) < KERNEL_TOLERANCE


@needs_kernels
def test_segments_of_every_type_split_over_threads() -> None:
    kinds = [k for k in BLOCK_FORMATS if BLOCK_FORMATS[k][0] == 256] + [
        k for k in BLOCK_FORMATS if BLOCK_FORMATS[k][0] == 32
    ]
    # Segment lengths that are not multiples of the kernel's work item.
    rows = GGMLRows.cat([_rows(kind, 19 + 3 * i, 768, seed=i) for i, kind in enumerate(kinds)])
    x = _x(768, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = _row_op(x, rows)
    finally:
        torch.set_num_threads(threads)
    assert _relative_error(got, x, rows) < KERNEL_TOLERANCE
    # Threads split the rows, never one row's sum: one thread gives the same bits.
    assert torch.equal(got, _row_op(x, rows))


@needs_kernels
def test_one_row_takes_the_row_loops() -> None:
    rows = _rows(next(iter(BLOCK_FORMATS)), 16, 256, seed=1)
    x = _x(256, seed=2)
    assert torch.equal(rows.linear_int8(x), _row_op(x, rows))
    with pytest.raises(RuntimeError, match=r"\[1, K\]"):
        _row_op(torch.cat([x, x]), rows)


@needs_kernels
@pytest.mark.parametrize(
    "kind", [k for k in BLOCK_FORMATS if BLOCK_FORMATS[k][0] == 32], ids=lambda k: k.name
)
def test_one_block_rows_and_rows_past_the_prefetch_distance(kind) -> None:
    # One block per row: only the loops' odd-block tail runs. 400 rows of
    # 18-34 bytes: the kernel asks for rows ~4 KiB ahead of the one it dots,
    # so both rows with such a row and the last rows (without one) are dotted.
    rows = _rows(kind, 400, 32, seed=int(kind))
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    got = _row_op(x, rows)
    assert _relative_error(got, x, rows) < KERNEL_TOLERANCE
    # Each row's sum is its own: the last rows alone give the same bits.
    assert torch.equal(got[0, 390:], _row_op(x, rows[390:])[0])
