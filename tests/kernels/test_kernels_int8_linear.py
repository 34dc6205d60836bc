"""The W8A8 kernel (kernels/csrc/int8_linear.cpp) against a float64 reference
of exactly its quantized arithmetic: per-token int8 activations, exact int32
block dot products, float32 scaling. Each path this CPU's level runs is
covered by the row counts (AMX-INT8 tiles from ``AMX_MIN_ROWS`` rows at the
amx level, vpdpbusd below; the portable path at levels without VNNI, which
test_kernels_isa_levels.py runs in child processes)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.block_codes import BLOCK, LANES, BlockCodes, RowCodes, quantize_int8
from kvmesh.kernels.int8_reference import quantize_rows, w8a8_reference

# kernels/csrc/int8_linear.cpp's kAmxMinRows.
AMX_MIN_ROWS = 16


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def _codes(out_features: int, in_features: int, kind: str, seed: int = 0) -> BlockCodes:
    """Symmetric int8 codes (Q8_0, offset -128 * scale), or 4-bit affine ones
    (Q4_1: codes 0..15, an offset of either sign per block)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    if kind == "q8_0":
        return quantize_int8(weight).to_panels()
    blocks = (out_features, in_features // BLOCK)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    scales = torch.rand(blocks, generator=g) * 0.01 + 1e-3
    offsets = torch.randn(blocks, generator=g) * 0.1
    return RowCodes(codes, scales, offsets).to_panels()


def _run(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    return torch.ops.kvmesh.int8_block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )


def _paths() -> list[int]:
    """Row counts that reach every path of the loaded level (ragged ones included)."""
    level = native.loaded_level()
    rows = [1, 3, 8, 11]
    if level is not None and level.amx_tiles:
        rows += [AMX_MIN_ROWS, 37]  # one full 16-row tile, then 2 + a 5-row remainder
    return rows


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize(("out_features", "in_features"), [(40, 96), (16, 32)])
def test_float32_matches_the_quantized_arithmetic(
    kind: str, out_features: int, in_features: int
) -> None:
    codes = _codes(out_features, in_features, kind)
    g = torch.Generator().manual_seed(1)
    for rows in _paths():
        x = torch.randn(rows, in_features, generator=g)
        if rows > 2:
            x[1] = 0.0  # an all-zero row: scale 0, output 0
        y = _run(x, codes)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        expected = w8a8_reference(x, codes)
        # Only float32 rounding of per-block products and their sum differs.
        torch.testing.assert_close(y.double(), expected, rtol=2e-6, atol=2e-6)


def test_bfloat16_rows_round_the_float32_result_once() -> None:
    codes = _codes(33, 64, "q4_1", seed=3)
    g = torch.Generator().manual_seed(4)
    for rows in _paths():
        x = torch.randn(rows, 64, generator=g).bfloat16()
        y = _run(x, codes)
        assert y.dtype == torch.bfloat16
        expected = _run(x.float(), codes).bfloat16()  # bfloat16 inputs are exact in float32
        assert torch.equal(y, expected), rows


def test_activation_quantization_is_per_token_round_to_nearest() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 1e-3] * 8, [2.0] + [0.0] * 31])
    q, scales = quantize_rows(x)
    assert torch.equal(scales, torch.tensor([1.0 / 127, 2.0 / 127]))
    assert q[0, :4].tolist() == [64, -127, 32, 0]  # 63.5 rounds to even, 0.127 to 0
    assert q[1, 0] == 127 and q[1, 1:].abs().sum() == 0
    # The kernel quantizes the same way: a one-hot weight reads q back out.
    eye = torch.eye(32)
    codes = RowCodes(
        (eye * 128).to(torch.uint8), torch.full((32, 1), 1.0), torch.zeros(32, 1)
    ).to_panels()
    assert torch.equal(_run(x, codes), (q * 128).float() * scales[:, None])


def test_padding_lanes_and_panels_are_not_written_past_out_features() -> None:
    codes = _codes(LANES + 1, 64, "q8_0", seed=5)  # two panels, the second with 1 lane
    x = torch.randn(AMX_MIN_ROWS + 1, 64)
    y = _run(x, codes)
    torch.testing.assert_close(y.double(), w8a8_reference(x, codes), rtol=2e-6, atol=2e-6)


def test_close_to_float_weights_times_float_activations() -> None:
    """The activations' rounding costs about half a step of 127 per row."""
    codes = _codes(64, 256, "q8_0", seed=6)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    exact = x.double() @ codes.dequantize().double().T
    error = (_run(x, codes).double() - exact).norm() / exact.norm()
    assert error < 0.01, error


def test_rejects_k_not_a_multiple_of_32() -> None:
    codes = _codes(16, 32, "q8_0")
    with pytest.raises(RuntimeError, match="features"):
        _run(torch.randn(2, 48), codes)
