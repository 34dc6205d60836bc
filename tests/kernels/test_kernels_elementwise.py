"""Fused RMSNorm (+ residual) and SwiGLU against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from worker.models.llama import rms_norm


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


@pytest.mark.parametrize("rows", [1, 16, 700])  # 700 rows: split over threads
@pytest.mark.parametrize("features", [576, 64, 100])
def test_rms_norm_matches_torch(rows: int, features: int) -> None:
    g = torch.Generator().manual_seed(rows * features)
    x = torch.randn(rows, features, generator=g) * 3
    weight = torch.randn(features, generator=g)
    expected = rms_norm(x, weight, 1e-5)
    # Only the order of the additions in mean(x²) differs: a few ulps.
    torch.testing.assert_close(
        torch.ops.kvmesh.rms_norm(x, weight, 1e-5), expected, atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("rows", [1, 16, 700])
def test_add_rms_norm_returns_the_norm_and_the_sum(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    normed, total = torch.ops.kvmesh.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)  # one float add: bit for bit
    torch.testing.assert_close(normed, rms_norm(residual + x, weight, 1e-5), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_silu_and_mul_matches_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(
        torch.ops.kvmesh.silu_and_mul(gate_up), expected, atol=1e-6, rtol=1e-5
    )


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
    ],
)
def test_bad_inputs_raise_clear_errors(call, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("tokens", [1, 16, 700])
def test_rotary_is_bit_identical_to_the_torch_ops(tokens: int) -> None:
    """Built with -ffp-contract=off: the same roundings as torch's separate ops."""
    from worker.models.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(64, 4096, 100000.0, None, torch.float32)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 960, generator=g) * 5
    query_key = qkv[:, :768].view(tokens, 12, 64)  # a strided view, as in the model
    cos, sin = rotary.tables(torch.randint(0, 4096, (tokens,), generator=g))
    expected = rotary.rotate(query_key, cos, sin)
    actual = torch.ops.kvmesh.rotary_embedding(query_key, cos, sin)
    assert actual.is_contiguous()
    assert torch.equal(actual, expected)


def test_rotary_rejects_bad_tables() -> None:
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.kvmesh.rotary_embedding(x, torch.randn(4, 1, 3), torch.randn(4, 1, 4))
    with pytest.raises(RuntimeError, match="odd head_dim"):
        torch.ops.kvmesh.rotary_embedding(
            torch.randn(4, 2, 7), torch.randn(4, 3), torch.randn(4, 3)
        )
