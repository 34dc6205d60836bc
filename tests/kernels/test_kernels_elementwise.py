"""Fused RMSNorm (+ residual), SwiGLU and rotary against the torch ops they replace.

Each runs in float32 and in bfloat16. The bfloat16 references are the model's
torch path in bfloat16, which rounds where transformers does (RMSNorm's
``x * inv`` before the weight, silu before the multiply, every rotary product).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import native
from kvmesh.worker.models.decoder import rms_norm
from tests.kernels.ulp import assert_bf16_close

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def _randn(*shape: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Only the order of the additions in mean(x²) differs: a few float32 ulps,
    so in bfloat16 at most one rounding boundary crossed (1 ulp)."""
    if actual.dtype == torch.bfloat16:
        assert_bf16_close(actual, expected, max_ulps=1)
    else:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 700])  # 700 rows: split over threads
@pytest.mark.parametrize("features", [576, 64, 100])
def test_rms_norm_matches_torch(rows: int, features: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * features)
    x = _randn(rows, features, generator=g, dtype=torch.float32).mul(3).to(dtype)
    weight = _randn(features, generator=g, dtype=dtype)
    assert_norm_close(torch.ops.kvmesh.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 700])
def test_add_rms_norm_returns_the_norm_and_the_sum(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x, residual = (
        _randn(rows, 576, generator=g, dtype=dtype),
        _randn(rows, 576, generator=g, dtype=dtype),
    )
    weight = _randn(576, generator=g, dtype=dtype)
    normed, total = torch.ops.kvmesh.add_rms_norm(x, residual, weight, 1e-5)
    assert total.dtype == dtype
    assert torch.equal(total, residual + x)  # one add, rounded once: bit for bit
    assert_norm_close(normed, rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_silu_and_mul_matches_torch(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = _randn(rows, 2 * 1536, generator=g, dtype=torch.float32).mul(4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    actual = torch.ops.kvmesh.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:
        # A few-ulp exp can flip silu's rounding (1 ulp); the product with up
        # is rounded again, so that flip can end 2 ulps away.
        assert_bf16_close(actual, expected, max_ulps=2)
    else:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_bf16_nan_and_inf_stay_nan_and_inf() -> None:
    """The bfloat16 rounding has no NaN branch (float_or_bf16.h): a NaN or an
    infinity in the input still comes out as NaN, and a finite value that
    rounds past bfloat16's largest becomes inf, as torch's rounding makes it."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 2.0, 3.0], [1.0, inf, 2.0, 3.0]], dtype=torch.bfloat16)
    weight = torch.ones(4, dtype=torch.bfloat16)
    normed = torch.ops.kvmesh.rms_norm(x, weight, 1e-5)
    # A NaN row is all NaN; an inf row is NaN at the inf (inf * 0) and 0 elsewhere.
    torch.testing.assert_close(normed, rms_norm(x, weight, 1e-5), rtol=0, atol=0, equal_nan=True)
    assert normed[0].isnan().all() and normed[1].isnan().sum() == 1
    gate_up = torch.tensor([[nan, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = torch.ops.kvmesh.silu_and_mul(gate_up)
    assert out[0, 0].isnan() and out[0, 1] == F.silu(gate_up[0, 1]) * gate_up[0, 3]
    big = torch.finfo(torch.bfloat16).max
    total = torch.ops.kvmesh.add_rms_norm(
        torch.full((1, 4), big, dtype=torch.bfloat16),
        torch.full((1, 4), big, dtype=torch.bfloat16),
        torch.ones(4, dtype=torch.bfloat16),
        1e-5,
    )[1]
    assert torch.equal(total, torch.full((1, 4), big, dtype=torch.bfloat16) * 2)
    assert total.isinf().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_gelu_tanh_and_mul_matches_torch(rows: int, dtype: torch.dtype) -> None:
    """Gemma's GeGLU as g * sigmoid(2 u): torch's 0.5 g (1 + tanh(u)) evaluated in
    float64 to a few ulps, including gates near 0 (where a 1 - 2 / (exp + 1) tanh
    would cancel) and the row's last I % 16 outputs (the portable loop). (Against
    torch in the dtype itself, bfloat16 differs by thousands of ulps at gates below
    about -3, where torch's own 1 + tanh(u) cancels and the kernel does not.)"""
    g = torch.Generator().manual_seed(rows)
    inter = 1536 + 7
    gate_up = _randn(rows, 2 * inter, generator=g, dtype=torch.float32).mul(4)
    gate_up[:, :40] *= 1e-4
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    actual = torch.ops.kvmesh.gelu_tanh_and_mul(gate_up)
    # Torch's own form, in the dtype: equal up to its cancellation (absolute error).
    torch.testing.assert_close(
        actual.float(), (F.gelu(gate, approximate="tanh") * up).float(), atol=0.05, rtol=2**-7
    )
    # The same function in float64 without the cancellation (0.5 (1 + tanh u) is
    # sigmoid(2 u) exactly), the activation rounded to the dtype, then the product
    # rounded: what the op stores, to a few ulps everywhere.
    g64 = gate.double()
    u = 0.7978845608028654 * (g64 + 0.044715 * g64**3)
    activated = (g64 * torch.sigmoid(2 * u)).to(dtype)
    expected = (activated.double() * up.double()).to(dtype)
    # Past gate ~ -10 the true product is below 1e-37, where exp saturates and
    # the kernel returns 0: counted as absolute, not in (subnormal) ulps.
    normal = expected.float().abs() > 1e-30
    assert bool((actual[~normal].float().abs() < 1e-30).all())
    actual, expected = actual[normal], expected[normal]
    if dtype == torch.bfloat16:
        assert_bf16_close(actual, expected, max_ulps=2)
    else:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(
            actual, (F.gelu(gate, approximate="tanh") * up)[normal], atol=1e-5, rtol=1e-5
        )


def test_gelu_tanh_and_mul_saturates_without_nan() -> None:
    gate_up = torch.tensor([[-200.0, 200.0, 0.0, 1.0, 1.0, 1.0]])
    out = torch.ops.kvmesh.gelu_tanh_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([[0.0, 200.0, 0.0]]))


def test_silu_and_mul_saturates_without_nan() -> None:
    gate_up = torch.tensor([[-200.0, 200.0, 0.0, 1.0, 1.0, 1.0]])
    out = torch.ops.kvmesh.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([[0.0, 200.0, 0.0]]))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: torch.ops.kvmesh.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), "weight"),
        (
            lambda: torch.ops.kvmesh.rms_norm(torch.randn(8, 2).T, torch.randn(8), 1e-5),
            "contiguous",
        ),
        (
            lambda: torch.ops.kvmesh.add_rms_norm(
                torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5
            ),
            "differ in shape",
        ),
        (lambda: torch.ops.kvmesh.silu_and_mul(torch.randn(2, 7)), "odd feature count"),
        (lambda: torch.ops.kvmesh.silu_and_mul(torch.randn(2, 8).double()), "float32"),
        (
            lambda: torch.ops.kvmesh.rms_norm(
                torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-5
            ),
            "weight is Float but x is BFloat16",
        ),
        (
            lambda: torch.ops.kvmesh.add_rms_norm(
                torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-5
            ),
            "residual is BFloat16 but x is Float",
        ),
        (
            lambda: torch.ops.kvmesh.rotary_embedding(
                torch.randn(4, 2, 8, dtype=torch.bfloat16), torch.randn(4, 4), torch.randn(4, 4)
            ),
            "cos is Float but x is BFloat16",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 16, 700])
def test_rotary_is_bit_identical_to_the_torch_ops(tokens: int, dtype: torch.dtype) -> None:
    """Built with -ffp-contract=off: the same roundings as torch's separate ops
    (in bfloat16, each product rounded before the sum, as torch stores it)."""
    from kvmesh.worker.models.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(64, 4096, 100000.0, None, dtype)
    g = torch.Generator().manual_seed(tokens)
    qkv = _randn(tokens, 960, generator=g, dtype=torch.float32).mul(5).to(dtype)
    query_key = qkv[:, :768].view(tokens, 12, 64)  # a strided view, as in the model
    cos, sin = rotary.tables(torch.randint(0, 4096, (tokens,), generator=g))
    expected = rotary.rotate(query_key, cos, sin)
    actual = torch.ops.kvmesh.rotary_embedding(query_key, cos, sin)
    assert actual.is_contiguous() and actual.dtype == dtype
    assert torch.equal(actual, expected)


def test_rotary_rejects_bad_tables() -> None:
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.kvmesh.rotary_embedding(x, torch.randn(4, 1, 3), torch.randn(4, 1, 4))
    with pytest.raises(RuntimeError, match="odd head_dim"):
        torch.ops.kvmesh.rotary_embedding(
            torch.randn(4, 2, 7), torch.randn(4, 3), torch.randn(4, 3)
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_vector_lanes_and_row_tail(dtype: torch.dtype) -> None:
    """37 outputs per row: two 16-lane vectors (the avx2 level up) and a 5-wide
    tail on the portable loop, with NaN, inf and saturating gates in both."""
    g = torch.Generator().manual_seed(37)
    gate = _randn(3, 37, generator=g, dtype=torch.float32).mul(6)
    up = _randn(3, 37, generator=g, dtype=torch.float32)
    for column in (3, 20, 34):  # first vector, second vector, tail
        gate[0, column], gate[1, column], gate[2, column] = float("nan"), float("inf"), -200.0
    gate[2, 5], gate[2, 35] = 200.0, 95.0
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    expected = F.silu(gate_up[:, :37]) * gate_up[:, 37:]
    actual = torch.ops.kvmesh.silu_and_mul(gate_up)
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.isinf(), expected.isinf())
    finite = expected.isfinite()
    if dtype == torch.bfloat16:
        assert_bf16_close(actual[finite], expected[finite], max_ulps=2)
    else:
        torch.testing.assert_close(actual[finite], expected[finite], atol=1e-6, rtol=1e-5)
