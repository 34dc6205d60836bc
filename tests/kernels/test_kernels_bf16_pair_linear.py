"""kernels/csrc/bf16_pair_linear.cpp over kernels/bf16_pairs.py's layout, and
PackedLinear's use of it for bfloat16 rows at the avx512_bf16 level."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.bf16_pairs import pack_pairs, packable, unpack_pairs
from kvmesh.kernels.block_codes import find_block_codes
from kvmesh.worker.models.linear import (
    MAX_PAIR_ROWS,
    MIN_PAIR_ROWS_OVER_CODES,
    PackedLinear,
    pair_kernel_loaded,
)
from tests.kernels.test_kernels_block_codes import q4_1_weight, q8_0_weight


def _bf16_dot_level_or_skip() -> None:
    level = native.loaded_level()
    if level is None or not level.bf16_dot_products:
        pytest.skip(f"the loaded kernels' level ({level}) has no vdpbf16ps")


def test_pack_pairs_puts_each_weight_where_the_kernel_reads_it() -> None:
    """Word 2l + j of pair p in item q is W[32 q + l, 2 p + j]; rows past the
    weight are zeros. (Pure layout: no kernel needed.)"""
    out_features, in_features = 41, 6
    weight = torch.arange(out_features * in_features, dtype=torch.float32).reshape(
        out_features, in_features
    )
    pairs = pack_pairs(weight)
    assert pairs.shape == (2, 3, 64) and pairs.dtype == torch.bfloat16
    for n in range(64):
        for k in range(in_features):
            value = pairs[n // 32, k // 2, 2 * (n % 32) + k % 2].item()
            assert value == (weight[n, k].bfloat16().item() if n < out_features else 0.0)
    assert not packable(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="feature pairs"):
        pack_pairs(torch.zeros(4, 7))


@pytest.mark.parametrize(("out_features", "in_features"), [(41, 6), (32, 576), (1, 2), (65, 64)])
def test_unpack_pairs_gives_back_the_bfloat16_weight(out_features: int, in_features: int) -> None:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3))
    unpacked = unpack_pairs(pack_pairs(weight), out_features)
    assert unpacked.is_contiguous()
    assert torch.equal(unpacked, weight.bfloat16())
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_pairs(pack_pairs(weight), 32 * pack_pairs(weight).shape[0] + 1)


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "with_bias"),
    [
        (1, 64, 16, False),  # the item's upper half is all padding
        (5, 96, 40, True),  # ragged: the last item's upper half is 8 outputs
        (12, 576, 64, False),  # one full row tile
        (16, 576, 49, False),  # 12 rows + 4 from L1/L2; 17 outputs in the last item
        (25, 128, 200, True),  # two full tiles and one row
        (33, 1536, 24, False),
        (40, 64, 100, True),
    ],
)
def test_pair_linear_matches_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    _bf16_dot_level_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    y = torch.ops.kvmesh.bf16_pair_linear(x, pack_pairs(weight), bias, out_features)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    expected = x.double() @ weight.bfloat16().double().T
    if bias is not None:
        expected = expected + bias.double()
    # float32 sums of exact products, then one bfloat16 rounding (2^-9 relative).
    error = (y.double() - expected).abs() / (expected.abs() + 1)
    assert error.max().item() < 2**-8
    # A one-feature shift of x (a wrong pair order) is far off.
    shifted = x.roll(1, dims=1).double() @ weight.bfloat16().double().T
    if bias is not None:
        shifted = shifted + bias.double()
    assert ((y.double() - shifted).abs() / (shifted.abs() + 1)).max().item() > 0.1


@pytest.mark.parametrize("make", [q8_0_weight, q4_1_weight])
@pytest.mark.parametrize("rows", [1, 12, 16, 29])
@pytest.mark.parametrize("out_features", [72, 96])
def test_pair_linear_equals_the_block_code_kernel_bit_for_bit(
    make, rows: int, out_features: int
) -> None:
    """Same bfloat16 weights (the packed words are the codes' rebuild), so the
    same outputs. A different summation order would rarely show here: the
    float32 sums are rounded to bfloat16 (reversing the kernel's order passed)."""
    _bf16_dot_level_or_skip()
    weight = make(out_features, 256, seed=rows)
    codes = find_block_codes(weight)
    assert codes is not None
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = torch.ops.kvmesh.bf16_pair_linear(x, pack_pairs(weight), None, out_features)
    expected = torch.ops.kvmesh.block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )
    assert torch.equal(y, expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_pair_linear_does_not_depend_on_thread_count(threads: int) -> None:
    _bf16_dot_level_or_skip()
    weight = torch.randn(300, 192, generator=torch.Generator().manual_seed(5))
    pairs = pack_pairs(weight)
    x = torch.randn(20, 192, generator=torch.Generator().manual_seed(6)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = torch.ops.kvmesh.bf16_pair_linear(x, pairs, None, 300)
        torch.set_num_threads(threads)
        assert torch.equal(torch.ops.kvmesh.bf16_pair_linear(x, pairs, None, 300), reference)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(3, 64)}, "bfloat16"),
        ({"x": torch.zeros(3, 62, dtype=torch.bfloat16)}, "features"),
        ({"out_features": 33}, "items"),
        ({"bias": torch.zeros(5, dtype=torch.bfloat16)}, "bias"),
        ({"pairs": torch.zeros(1, 32, 32, dtype=torch.bfloat16)}, "pairs"),
    ],
)
def test_pair_linear_rejects_bad_inputs(change: dict, message: str) -> None:
    _bf16_dot_level_or_skip()
    args = {
        "x": torch.zeros(3, 64, dtype=torch.bfloat16),
        "pairs": pack_pairs(torch.zeros(20, 64)),
        "bias": None,
        "out_features": 20,
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvmesh.bf16_pair_linear(
            args["x"], args["pairs"], args["bias"], args["out_features"]
        )


def _calls_pair_kernel(linear: PackedLinear, x: torch.Tensor, monkeypatch) -> bool:
    calls = []
    original = torch.ops.kvmesh.bf16_pair_linear

    def spy(*args):
        calls.append(args)
        return original(*args)

    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.kvmesh, "bf16_pair_linear", spy)
        linear(x)
    return bool(calls)


def test_packed_linear_runs_pairs_between_codes_and_onednn(monkeypatch) -> None:
    """At avx512_bf16: a weight with codes runs them below
    MIN_PAIR_ROWS_OVER_CODES rows, the pairs up to MAX_PAIR_ROWS, oneDNN
    above; a dense weight runs the pairs from 1 row. Elsewhere no pairs are
    kept. Every path gives the bf16 matmul's values."""
    weight = q8_0_weight(80, 128, seed=9)
    dense = weight + torch.randn(80, 128, generator=torch.Generator().manual_seed(1)) * 1e-4
    with_codes = PackedLinear(weight, dtype=torch.bfloat16)
    plain = PackedLinear(dense, dtype=torch.bfloat16)
    if not pair_kernel_loaded():
        assert with_codes._pairs is None and plain._pairs is None
        pytest.skip(f"pairs run only at the avx512_bf16 level, not {native.loaded_level()}")
    assert with_codes.uses_block_codes and not plain.uses_block_codes
    assert with_codes.resident_bytes >= 80 * 128 * 2 + with_codes.codes.nbytes
    cases = [
        (with_codes, MIN_PAIR_ROWS_OVER_CODES - 1, False),
        (with_codes, MIN_PAIR_ROWS_OVER_CODES, True),
        (with_codes, MAX_PAIR_ROWS, True),
        (with_codes, MAX_PAIR_ROWS + 1, False),
        (plain, 1, True),
        (plain, MAX_PAIR_ROWS + 1, False),
    ]
    for linear, rows, expect_pairs in cases:
        source = weight if linear is with_codes else dense
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert _calls_pair_kernel(linear, x, monkeypatch) == expect_pairs, (rows, expect_pairs)
        expected = x.double() @ source.bfloat16().double().T
        torch.testing.assert_close(linear(x).double(), expected, atol=2e-2, rtol=2**-7)
    # Codes-only weights (GGUF, --quantization int8) keep no pairs.
    codes = find_block_codes(weight)
    assert PackedLinear.from_codes(codes, None, torch.bfloat16)._pairs is None
    # float32 models keep none.
    assert PackedLinear(weight)._pairs is None
