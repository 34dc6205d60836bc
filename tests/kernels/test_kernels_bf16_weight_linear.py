"""kernels/csrc/bf16_weight_linear.cpp over kernels/bf16_weights.py's panels, and
PackedLinear keeping a bfloat16 checkpoint's float32 weight as those words."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import batch_invariant, native
from kvmesh.kernels.bf16_weights import (
    exactly_bfloat16,
    pack_float_panels,
    pack_panels,
    unpack_panels,
)
from kvmesh.worker.models import linear as linear_module
from kvmesh.worker.models.linear import MAX_BF16_WEIGHT_KERNEL_ROWS, PackedLinear


def _kernels_or_skip() -> None:
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"C++ kernels unavailable: {reason}")


def _bf16_valued(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight with bfloat16 values: what a bfloat16 checkpoint loads as."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g).bfloat16().float()


def test_exactly_bfloat16_reads_the_low_bits() -> None:
    weight = _bf16_valued(8, 32, 0)
    assert exactly_bfloat16(weight)
    nudged = weight.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    assert not exactly_bfloat16(nudged)
    assert not exactly_bfloat16(weight.bfloat16())  # only float32 weights qualify
    with pytest.raises(ValueError, match="not an exactly bfloat16 matrix"):
        pack_panels(nudged)


@pytest.mark.parametrize(("out_features", "in_features"), [(41, 6), (32, 576), (1, 3), (16, 64)])
def test_panels_round_trip_exactly(out_features: int, in_features: int) -> None:
    weight = _bf16_valued(out_features, in_features, out_features)
    panels = pack_panels(weight)
    assert panels.dtype == torch.bfloat16
    assert panels.shape == ((out_features + 15) // 16, in_features, 16)
    for n in (0, out_features - 1):
        for k in (0, in_features - 1):
            assert panels[n // 16, k, n % 16].item() == weight[n, k].item()
    assert torch.equal(unpack_panels(panels, out_features), weight)
    scratch = torch.full((out_features * in_features + 7,), float("nan"))
    assert torch.equal(unpack_panels(panels, out_features, scratch), weight)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_panels(panels, panels.shape[0] * 16 + 1)


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "with_bias"),
    [
        (1, 64, 16, False),
        (5, 96, 40, True),  # ragged last panel
        (6, 576, 64, False),  # one AVX2 row tile
        (13, 576, 49, True),  # tiles of 6 (AVX2) or 12 (AVX-512) and a remainder
        (64, 100, 3, False),  # K not a multiple of anything; one partial panel
    ],
)
def test_kernel_matches_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    _kernels_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = _bf16_valued(out_features, in_features, rows)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    y = torch.ops.kvmesh.bf16_weight_linear(x, pack_panels(weight), bias, out_features)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    expected = x.double() @ weight.double().T
    if bias is not None:
        expected = expected + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + 1.0
    assert ((y.double() - expected).abs() / scale).max().item() < 1e-6


def test_a_row_does_not_depend_on_the_others() -> None:
    """Each row sums over k in order, whatever the batch: rows alone equal rows together."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 320, generator=g)
    panels = pack_panels(_bf16_valued(70, 320, 7))
    together = torch.ops.kvmesh.bf16_weight_linear(x, panels, None, 70)
    for m in range(11):
        alone = torch.ops.kvmesh.bf16_weight_linear(x[m : m + 1], panels, None, 70)
        assert torch.equal(alone[0], together[m])


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (32, 64, 16),  # the smallest batch on the blocked GEMM (AVX2 level)
        (101, 1100, 70),  # k in three slices (368, 368, 364); row blocks of 48; a ragged panel
        (48, 640, 40),  # k in one 640-deep slice (up to 768 run whole)
        (257, 576, 600),  # chunks of panels over both threads
    ],
)
def test_large_batches_equal_each_row_alone(rows: int, in_features: int, out_features: int) -> None:
    """Prefill-sized batches (the blocked GEMM where it is built) keep each row's
    sum the chain of the one-row path, bias last: bitwise equal to the row alone."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = _bf16_valued(out_features, in_features, rows + 1)
    bias = torch.randn(out_features, generator=g)
    panels = pack_panels(weight)
    together = torch.ops.kvmesh.bf16_weight_linear(x, panels, bias, out_features)
    for m in (0, 1, rows // 2, rows - 1):
        alone = torch.ops.kvmesh.bf16_weight_linear(x[m : m + 1], panels, bias, out_features)
        assert torch.equal(alone[0], together[m]), m
    expected = x.double() @ weight.double().T + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + 1.0
    assert ((together.double() - expected).abs() / scale).max().item() < 1e-6


def test_packed_linear_keeps_only_the_words_and_matches_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _kernels_or_skip()
    weight = _bf16_valued(72, 256, 11)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(12))
    packed = PackedLinear(weight, bias)
    # Half a float32 copy: the words are all it keeps (plus the bias, held apart).
    assert packed.weight is None and packed.resident_bytes == 80 * 256 * 2  # 5 panels of 16
    assert torch.equal(packed.dense_weight(), weight)
    calls: list[int] = []
    kernel = torch.ops.kvmesh.bf16_weight_linear

    def counting(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])  # type: ignore[union-attr]
        return kernel(*args)

    monkeypatch.setattr(
        linear_module.torch.ops.kvmesh, "bf16_weight_linear", counting, raising=False
    )
    g = torch.Generator().manual_seed(13)
    for rows in (1, 16, MAX_BF16_WEIGHT_KERNEL_ROWS, MAX_BF16_WEIGHT_KERNEL_ROWS + 1):
        x = torch.randn(rows, 256, generator=g)
        torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    # Decode-sized batches on the kernel; the larger ones on its blocked GEMM
    # where it is built, else the words widened for oneDNN.
    largest = [MAX_BF16_WEIGHT_KERNEL_ROWS + 1] if native.blocked_gemm_loaded() else []
    assert calls == [1, 16, MAX_BF16_WEIGHT_KERNEL_ROWS, *largest]


def test_float32_weights_that_are_not_bfloat16_stay_dense() -> None:
    _kernels_or_skip()
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    packed = PackedLinear(weight)
    assert packed.resident_bytes == 32 * 64 * 4  # oneDNN's copy (or the plain weight)


def test_batch_invariant_mode_runs_every_batch_on_the_kernel() -> None:
    _kernels_or_skip()
    weight = _bf16_valued(40, 128, 21)
    packed = PackedLinear(weight)
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(22))
    with batch_invariant.forced(True):
        together = packed(x)
        alone = packed(x[5:6])
    assert torch.equal(alone[0], together[5])


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"), [(1, 64, 16), (7, 96, 40), (77, 600, 33)]
)
def test_float_panels_match_float64_and_each_row_alone(
    rows: int, in_features: int, out_features: int
) -> None:
    """float_panel_linear: any float32 weight in the same panels, the same per-row chains."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(rows + 100)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    panels = pack_float_panels(weight)
    assert panels.dtype == torch.float32 and torch.equal(
        unpack_panels(panels, out_features), weight
    )
    y = torch.ops.kvmesh.float_panel_linear(x, panels, bias, out_features)
    expected = x.double() @ weight.double().T + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + 1.0
    assert ((y.double() - expected).abs() / scale).max().item() < 1e-6
    for m in (0, rows - 1):
        alone = torch.ops.kvmesh.float_panel_linear(x[m : m + 1], panels, bias, out_features)
        assert torch.equal(alone[0], y[m])
