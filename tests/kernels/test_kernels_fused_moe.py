"""The fused MoE kernel (kernels/csrc/fused_moe_cpu.cpp) over the experts'
panels (worker/models/moe.py's pack_expert_panels) against the grouped path
over the plain weights (grouped_experts), over random routings: experts left
without rows, one token, many (the blocked GEMM's runs), top-k 1/2/8, SiLU and
GELU-tanh, float32 and bfloat16 activations and weights, widths that are not
a multiple of the vector lanes or of the 16-feature panels."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.worker.models import moe


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def _layer(
    tokens: int, experts: int, hidden: int, width: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """(x, router, gate_up, down), scaled so every stage's values stay O(1)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return (
        randn(tokens, hidden, scale=1.0),
        randn(experts, hidden, scale=0.5),
        randn(experts, 2 * width, hidden, scale=hidden**-0.5),
        randn(experts, hidden, width, scale=width**-0.5),
    )


def _fused(*layer: torch.Tensor, routing: tuple[int, bool, bool]) -> torch.Tensor:
    """fused_experts over the layer (x, router, gate_up, down), its weights packed
    in their own dtype; routing: (top_k, renormalize, gelu)."""
    x, router, gate_up, down = layer
    panels = moe.pack_expert_panels(gate_up, down, gate_up.dtype)
    return moe.fused_experts(x, router, *panels, *routing)


def _packed_op(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    panels = moe.pack_expert_panels(gate_up, down, gate_up.dtype)
    return torch.ops.kvmesh.fused_moe(x, ids, weights, *panels, down.shape[2], False)


# (tokens, experts, hidden, width, top_k, gelu)
CASES = [
    (1, 8, 64, 32, 1, False),  # one token: seven experts without rows
    (1, 8, 64, 32, 8, True),  # one token, every expert
    (5, 16, 96, 48, 2, False),
    (16, 32, 128, 64, 4, True),  # a decode step's shape, scaled down
    (300, 8, 64, 40, 2, False),  # a prefill chunk: many rows per expert, threads
    (7, 6, 44, 20, 2, True),  # widths off the 8- and 16-lane vectors: scalar tails
]


@pytest.mark.parametrize(("tokens", "experts", "hidden", "width", "top_k", "gelu"), CASES)
def test_float32_equals_grouped_experts(
    tokens: int, experts: int, hidden: int, width: int, top_k: int, gelu: bool
) -> None:
    x, router, gate_up, down = _layer(tokens, experts, hidden, width, torch.float32, tokens)
    for renormalize in (True, False):
        expected = moe.grouped_experts(x, router, gate_up, down, top_k, renormalize, gelu)
        actual = _fused(x, router, gate_up, down, routing=(top_k, renormalize, gelu))
        torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-5)


def test_some_experts_get_no_rows() -> None:
    """The routing the float32 cases run leaves experts empty (what they must survive)."""
    x, router, _, _ = _layer(1, 8, 64, 32, torch.float32, 1)
    _, ids = moe.route(x, router, 1, True)
    assert torch.bincount(ids.reshape(-1), minlength=8).eq(0).sum() == 7


@pytest.mark.parametrize("gelu", [False, True])
def test_bfloat16_rounds_where_the_grouped_path_rounds(gelu: bool) -> None:
    x, router, gate_up, down = _layer(64, 16, 128, 64, torch.bfloat16, 2)
    expected = moe.grouped_experts(x, router, gate_up, down, 4, True, gelu)
    actual = _fused(x, router, gate_up, down, routing=(4, True, gelu))
    assert actual.dtype == torch.bfloat16
    # Rounded at the same points, the two differ where a float32 sum's order
    # moves a value across a rounding boundary (then carried through the
    # rounded additions of a token's experts, where near-zero sums cancel):
    # mostly bit-identical, and no further from the float32 result.
    identical = float((actual == expected).float().mean())
    assert identical > 0.9, f"only {identical:.3f} bit-identical"
    exact = moe.grouped_experts(*(t.float() for t in (x, router, gate_up, down)), 4, True, gelu)
    error = (actual.float() - exact).abs().max()
    assert error <= 1.25 * (expected.float() - exact).abs().max() + 1e-3


def test_bfloat16_weights_under_float32_activations_are_widened_exactly() -> None:
    """A bfloat16 checkpoint served in float32: the kernel reads the bfloat16
    experts, equal to the grouped path over the same weights widened."""
    x, router, gate_up, down = _layer(16, 8, 96, 48, torch.float32, 3)
    gate_up, down = gate_up.bfloat16(), down.bfloat16()
    expected = moe.grouped_experts(x, router, gate_up.float(), down.float(), 2, True)
    actual = _fused(x, router, gate_up, down, routing=(2, True, False))
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [24, 140])
def test_a_tokens_output_does_not_depend_on_its_step(tokens: int) -> None:
    """Every dot product sums in one order whatever the rows beside it, and each
    token's experts in expert order: a token alone gets its batch's bits
    (for the same routing: the router's F.linear is another matter). 24 tokens
    x top-2 give each expert a few rows (the panel loop); 140 give each ~35,
    past the blocked GEMM's threshold on the AVX2 level; a token alone takes
    the panel loop."""
    x, router, gate_up, down = _layer(tokens, 8, 96, 48, torch.float32, 4)
    weights, ids = moe.route(x, router, 2, True)
    batch = _packed_op(x, ids, weights, gate_up, down)
    for token in (0, 11, tokens - 1):
        one = slice(token, token + 1)
        alone = _packed_op(x[one], ids[one], weights[one], gate_up, down)
        assert torch.equal(alone[0], batch[token])


def test_a_long_step_runs_in_pieces_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    x, router, gate_up, down = _layer(150, 8, 64, 40, torch.float32, 7)
    panels = moe.pack_expert_panels(gate_up, down, torch.float32)
    whole = moe.fused_experts(x, router, *panels, 2, True)
    monkeypatch.setattr(moe, "FUSED_CHUNK_TOKENS", 64)
    assert torch.equal(moe.fused_experts(x, router, *panels, 2, True), whole)


def test_panels_hold_the_weights() -> None:
    """pack_expert_panels' layout, read back feature by feature."""
    _, _, gate_up, down = _layer(1, 3, 20, 18, torch.float32, 8)
    gate_up_panels, down_panels = moe.pack_expert_panels(gate_up, down, torch.float32)
    assert gate_up_panels.shape == (3, 2, 2, 20, 16) and down_panels.shape == (3, 2, 18, 16)
    for feature in (0, 15, 16, 17):
        torch.testing.assert_close(
            gate_up_panels[:, feature // 16, 0, :, feature % 16],
            gate_up[:, feature],
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(
            gate_up_panels[:, feature // 16, 1, :, feature % 16],
            gate_up[:, 18 + feature],
            rtol=0,
            atol=0,
        )
    assert not gate_up_panels[:, 1, :, :, 2:].any()  # features past the width
    torch.testing.assert_close(down_panels[:, 1, :, 3], down[:, 19], rtol=0, atol=0)
    assert not down_panels[:, 1, :, 4:].any()


def test_bad_routing_is_refused() -> None:
    x, _, gate_up, down = _layer(2, 4, 32, 16, torch.float32, 5)
    gate_up_panels, down_panels = moe.pack_expert_panels(gate_up, down, torch.float32)
    weights = torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        torch.ops.kvmesh.fused_moe(
            x, torch.tensor([[0, 4], [1, 2]]), weights, gate_up_panels, down_panels, 16, False
        )
    with pytest.raises(RuntimeError, match="down is BFloat16 but gate_up is Float"):
        torch.ops.kvmesh.fused_moe(
            x,
            torch.tensor([[0, 1], [1, 2]]),
            weights,
            gate_up_panels,
            down_panels.bfloat16(),
            16,
            False,
        )
    with pytest.raises(RuntimeError, match="gate_up must be contiguous panels"):
        torch.ops.kvmesh.fused_moe(
            x, torch.tensor([[0, 1], [1, 2]]), weights, gate_up, down, 16, False
        )


def test_a_step_without_tokens_gives_no_rows() -> None:
    x, router, gate_up, down = _layer(0, 4, 32, 16, torch.float32, 6)
    assert _fused(x, router, gate_up, down, routing=(2, True, False)).shape == (0, 32)
