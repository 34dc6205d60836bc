"""Exact 8-bit block codes: found only where they are exact, and the kernel over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import native
from kvmesh.kernels.block_codes import BLOCK, find_block_codes
from kvmesh.worker.models.linear import MAX_BLOCK_CODE_ROWS, PackedLinear


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """What GGUF Q4_1 dequantizes to: float16 scale and minimum, codes 0..15 per 32."""
    g = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // BLOCK, 1)
    scale = (torch.rand(blocks, generator=g) * 0.02 + 1e-3).half().float()
    low = (torch.randn(blocks, generator=g) * 0.1).half().float()
    codes = torch.randint(0, 16, (out_features, in_features // BLOCK, BLOCK), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # the quantizer maps min to 0 and max to 15
    return (codes.float() * scale + low).reshape(out_features, in_features)


def q8_0_weight(
    out_features: int, in_features: int, seed: int = 0, scale_size: float = 0.01
) -> torch.Tensor:
    """What GGUF Q8_0 dequantizes to: a float16 scale, codes -127..127 per 32."""
    g = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // BLOCK, 1)
    scale = (torch.rand(blocks, generator=g) * scale_size + scale_size / 100).half().float()
    codes = torch.randint(-127, 128, (out_features, in_features // BLOCK, BLOCK), generator=g)
    codes[..., 0] = torch.where(torch.rand(blocks[:2], generator=g) < 0.5, -127, 127)
    return (codes.float() * scale).reshape(out_features, in_features)


@pytest.mark.parametrize("make", [q4_1_weight, q8_0_weight])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (37, 96), (5, 32)])
def test_quantized_weights_round_trip_bit_for_bit(
    make, out_features: int, in_features: int
) -> None:
    weight = make(out_features, in_features)
    codes = find_block_codes(weight)
    assert codes is not None
    assert codes.codes.dtype == torch.uint8
    if out_features % 16 == 0:  # else padding lanes dominate a tiny tensor
        # 1 byte per weight + 8 bytes of scale and offset per 32: 1.25 of 4 bytes.
        assert codes.nbytes == weight.numel() * 1.25
    assert torch.equal(codes.dequantize().view(torch.int32), weight.view(torch.int32))


def test_blocks_of_both_layouts_in_one_tensor() -> None:
    weight = torch.cat([q4_1_weight(16, 64, seed=1), q8_0_weight(16, 64, seed=2)])
    weight = weight[torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    codes = find_block_codes(weight)
    assert codes is not None and torch.equal(codes.dequantize(), weight)


def test_constant_blocks_have_zero_scale() -> None:
    weight = torch.full((16, 64), 0.25)
    codes = find_block_codes(weight)
    assert codes is not None and torch.equal(codes.dequantize(), weight)


def test_one_changed_weight_refuses_the_whole_tensor() -> None:
    weight = q4_1_weight(32, 64)
    weight[7, 13] = torch.nextafter(weight[7, 13], torch.tensor(1.0))
    assert find_block_codes(weight) is None


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(32, 64),  # never quantized
        torch.randn(32, 48),  # in_features not a multiple of 32
        torch.randn(32, 64).double(),  # not float32
        torch.randn(64),  # not a matrix
    ],
)
def test_weights_without_exact_codes_are_refused(weight: torch.Tensor) -> None:
    assert find_block_codes(weight) is None


def test_non_finite_weights_are_refused() -> None:
    weight = q4_1_weight(16, 64)
    weight[0, 0] = float("inf")
    assert find_block_codes(weight) is None


@pytest.mark.parametrize("rows", [1, 2, 7, 15, 16, 17, 31, 40])
@pytest.mark.parametrize("out_features", [16, 37, 200])
def test_kernel_matches_float64_matmul(rows: int, out_features: int) -> None:
    """Every row-tile size (1..16 plus remainders) and panels with padding lanes."""
    weight = q4_1_weight(out_features, 128, seed=rows)
    codes = find_block_codes(weight)
    assert codes is not None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(out_features))
    y = torch.ops.kvmesh.block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )
    expected = (x.double() @ weight.double().T).float()
    assert y.shape == (rows, out_features)
    # float32 accumulation over 128 products of O(0.1) terms: ~1e-6 relative.
    torch.testing.assert_close(y, expected, atol=2e-5, rtol=1e-5)


def _bf16_level_or_skip() -> None:
    level = native.loaded_level()
    assert level is not None
    if not level.bf16_dot_products:
        pytest.skip(f"the loaded {level.name} level multiplies float32 activations only")


@pytest.mark.parametrize("rows", [1, 2, 9, 16, 17, 24, 40, 64, 65, 130])
@pytest.mark.parametrize("out_features", [16, 37, 200])
def test_bf16_kernel_matches_bf16_weights_in_float64(rows: int, out_features: int) -> None:
    """bfloat16 activations times the weights rounded to bfloat16 (as torch rounds a
    bf16 model's weights), accumulated in float32, rounded once to bfloat16.
    At the amx level: one and several 16-row tiles, a partial last tile, and
    more than one 64-row pass."""
    _bf16_level_or_skip()
    weight = q8_0_weight(out_features, 128, seed=rows)
    codes = find_block_codes(weight)
    assert codes is not None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(out_features))
    x = x.bfloat16()
    y = torch.ops.kvmesh.block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    expected = x.double() @ weight.bfloat16().double().T
    # One bfloat16 rounding of the output (2^-9 relative) dominates float32's.
    torch.testing.assert_close(y.double(), expected, atol=1e-3, rtol=2**-8)


def test_bf16_kernel_agrees_with_onednn_bf16() -> None:
    """The codes and oneDNN's bf16 matmul run the same bf16 weights: outputs
    differ only by float32 summation order before the one bf16 rounding."""
    _bf16_level_or_skip()
    weight = q4_1_weight(96, 256, seed=4)
    linear = PackedLinear(weight, dtype=torch.bfloat16)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    reference = F.linear(x.float(), weight.bfloat16().float()).bfloat16()
    y = linear(x)
    assert y.dtype == torch.bfloat16
    mismatched = (y != reference).float().mean().item()
    torch.testing.assert_close(y.float(), reference.float(), atol=1e-2, rtol=2**-7)
    assert mismatched < 0.05, f"{mismatched:.1%} of outputs differ by a bf16 rounding"


def test_packed_linear_uses_codes_only_for_small_batches() -> None:
    weight = q8_0_weight(64, 96, seed=3)
    bias = torch.randn(64)
    linear = PackedLinear(weight, bias)
    assert linear.uses_block_codes
    for rows in (1, MAX_BLOCK_CODE_ROWS, MAX_BLOCK_CODE_ROWS + 1, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=2e-5, rtol=1e-5)
    assert not PackedLinear(torch.randn(64, 96)).uses_block_codes
    assert not PackedLinear(weight, use_block_codes=False).uses_block_codes


def _args() -> dict[str, torch.Tensor | int]:
    codes = find_block_codes(q4_1_weight(32, 64))
    assert codes is not None
    return {
        "x": torch.randn(4, 64),
        "codes": codes.codes,
        "scales": codes.scales,
        "offsets": codes.offsets,
        "out_features": 32,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.randn(4, 96)}, "x has 96 features"),
        ({"x": torch.randn(4, 64).double()}, "float32"),
        ({"x": torch.randn(64, 4).T}, "contiguous"),
        ({"out_features": 40}, "does not match 2 panels"),
        ({"out_features": 16}, "does not match 2 panels"),
        ({"scales": torch.zeros(2, 3, 16)}, "scales and offsets"),
        ({"codes": torch.zeros(2, 64, 16, dtype=torch.int32)}, "uint8"),
    ],
)
def test_kernel_rejects_bad_inputs(change: dict, message: str) -> None:
    args = {**_args(), **change}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvmesh.block_code_linear(*args.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_kernel_result_does_not_depend_on_thread_count(threads: int, dtype: torch.dtype) -> None:
    """Threads steal panels from each other (work_stealing.h): every panel must
    be computed exactly once whatever the split, and each panel's arithmetic is
    the same on any thread, so results are bitwise equal (bfloat16 on AMX
    tiles too: each thread configures and releases its own)."""
    if dtype == torch.bfloat16:
        _bf16_level_or_skip()
    weight = q8_0_weight(16 * 37 + 5, 64, seed=9)
    codes = find_block_codes(weight)
    assert codes is not None
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (x, codes.codes, codes.scales, codes.offsets, codes.out_features)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = torch.ops.kvmesh.block_code_linear(*args)
        torch.set_num_threads(threads)
        for _ in range(5):
            assert torch.equal(torch.ops.kvmesh.block_code_linear(*args), expected)
    finally:
        torch.set_num_threads(before)


def q4_0_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """What GGUF Q4_0 dequantizes to: a signed float16 scale, (code - 8) * scale."""
    g = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // BLOCK, 1)
    scale = ((torch.rand(blocks, generator=g) - 0.5) * 0.02).half().float()
    codes = torch.randint(0, 16, (out_features, in_features // BLOCK, BLOCK), generator=g)
    codes[..., 0] = 0  # the largest magnitude: code 0, the scale's sign
    return ((codes.float() - 8) * scale).reshape(out_features, in_features)


def _mixed_weight(seed: int) -> torch.Tensor:
    """Blocks of every layout, constant and zero blocks, tiny (subnormal-scale) ones."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        q4_1_weight(16, 256, seed=seed),
        q8_0_weight(16, 256, seed=seed + 1),
        q4_0_weight(16, 256, seed=seed + 2),
        q8_0_weight(16, 256, seed=seed + 3, scale_size=1e-6),  # float16-subnormal scales
        torch.zeros(2, 256),
        torch.full((2, 256), -0.0),
        torch.full((2, 256), 3.5),
    ]
    weight = torch.cat(rows)
    return weight[torch.randperm(weight.shape[0], generator=g)].contiguous()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_search_finds_what_the_torch_search_finds(seed: int) -> None:
    """kernels/csrc/block_code_search.cpp against the torch search, bit for bit."""
    weight = _mixed_weight(seed)
    ours = find_block_codes(weight)
    reference = find_block_codes(weight, use_native=False)
    assert ours is not None and reference is not None
    for got, want in zip(
        (ours.codes, ours.scales, ours.offsets),
        (reference.codes, reference.scales, reference.offsets),
        strict=True,
    ):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(ours.dequantize(), weight)  # by value: the -0.0 blocks come back 0.0


@pytest.mark.parametrize("where", ["first", "last", "unsampled"])
@pytest.mark.parametrize("damage", ["one_ulp", "inf", "nan"])
def test_native_search_refuses_what_the_torch_search_refuses(where: str, damage: str) -> None:
    weight = _mixed_weight(0)
    row, col = {"first": (0, 0), "last": (-1, -1), "unsampled": (3, 33)}[where]
    value = weight[row, col]
    weight[row, col] = {
        "one_ulp": torch.nextafter(value, torch.tensor(1.0)),
        "inf": torch.tensor(float("inf")),
        "nan": torch.tensor(float("nan")),
    }[damage]
    assert find_block_codes(weight, use_native=False) is None
    assert find_block_codes(weight) is None
