"""kernels/csrc/amx_linear.cpp: bfloat16 x Wᵀ on AMX tiles over a plain weight,
and PackedLinear's use of it for dense bfloat16 weights."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.worker.models import linear as linear_module
from kvmesh.worker.models.linear import MAX_AMX_LINEAR_ROWS, PackedLinear, amx_linear_takes

pytestmark = pytest.mark.skipif(
    not native.amx_tiles_loaded(),
    reason=f"the loaded kernels' level has no AMX tiles ({native.loaded_level()})",
)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "with_bias"),
    [
        (1, 64, 16, False),  # one row, one A tile (both tiles of the item overlap)
        (5, 96, 40, True),  # ragged outputs: the last item's tiles shift back
        (16, 576, 960, False),
        (17, 576, 49, True),  # one token past a tile; 49 outputs
        (33, 1536, 576, True),  # two 32-token blocks, the second of one token
        (70, 64, 100, False),
    ],
)
def test_amx_linear_matches_float64(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    y = torch.ops.kvmesh.amx_linear(x, weight, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    expected = _reference(x, weight, bias)
    # float32 sums of exact products, then one bfloat16 rounding (2^-9 relative).
    error = (y.double() - expected).abs() / (expected.abs() + 1)
    assert error.max().item() < 2**-8
    # A one-feature shift of x (a wrong pair layout) is far off.
    shifted = _reference(x.roll(1, dims=1), weight, bias)
    assert ((y.double() - shifted).abs() / (shifted.abs() + 1)).max().item() > 0.1


def test_amx_linear_reads_a_strided_weight_in_place() -> None:
    """A row-strided weight (a slice of a wider one) gives the same as its copy."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(48, 128, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g).bfloat16()
    view = wide[:, 32:96]
    assert torch.equal(
        torch.ops.kvmesh.amx_linear(x, view, None),
        torch.ops.kvmesh.amx_linear(x, view.contiguous(), None),
    )


def test_amx_linear_refuses_what_it_cannot_run() -> None:
    x = torch.randn(2, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kvmesh.amx_linear(x, torch.randn(32, 48).bfloat16(), None)
    with pytest.raises(RuntimeError, match="at least 16 outputs"):
        torch.ops.kvmesh.amx_linear(x[:, :32].contiguous(), torch.randn(8, 32).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvmesh.amx_linear(x.float(), torch.randn(32, 48), None)


def test_packed_linear_keeps_a_dense_bf16_weight_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """No oneDNN copy: small batches run amx_linear, larger ones oneDNN over the
    same plain weight (each bit for bit); both agree with F.linear in bfloat16."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(80, 96, generator=g) / 10  # random: no block codes
    bias = torch.randn(80, generator=g)
    linear = PackedLinear(weight, bias, dtype=torch.bfloat16)
    assert amx_linear_takes(weight.bfloat16()) and not linear.uses_block_codes
    assert linear.resident_bytes == 80 * 96 * 2  # one bfloat16 copy
    monkeypatch.setattr(linear_module, "MAX_AMX_LINEAR_ROWS", 8)
    w, b = weight.bfloat16(), bias.bfloat16()
    for rows in (3, 8, 9, 40):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        y = linear(x)
        if rows <= 8:
            assert torch.equal(y, torch.ops.kvmesh.amx_linear(x, w, b))
        else:
            onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            assert torch.equal(y, onednn)
        expected = torch.nn.functional.linear(x.double(), w.double(), b.double())
        assert ((y.double() - expected).abs() / (expected.abs() + 1)).max().item() < 2**-7
    assert MAX_AMX_LINEAR_ROWS >= 32  # decode batches take the kernel


def test_amx_linear_switch_packs_for_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVMESH_AMX_LINEAR=0 (the A/B switch): oneDNN's packed copy, no plain weight."""
    monkeypatch.setenv("KVMESH_AMX_LINEAR", "0")
    weight = torch.randn(80, 96, generator=torch.Generator().manual_seed(5)) / 10
    linear = PackedLinear(weight, dtype=torch.bfloat16)
    assert not amx_linear_takes(weight.bfloat16())
    assert linear.weight is None  # the packed copy replaced it
    x = torch.randn(4, 96).bfloat16()
    expected = torch.nn.functional.linear(x.double(), weight.bfloat16().double())
    assert ((linear(x).double() - expected).abs() / (expected.abs() + 1)).max().item() < 2**-7


def test_block_coded_weights_past_the_codes_kernel_take_the_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight with block codes (the default model): small batches on the codes
    kernel, then amx_linear, then oneDNN over the plain bfloat16 weight, never a
    oneDNN-packed copy (slower at every batch past the codes: linear.py)."""
    from tests.kernels.test_kernels_block_codes import q8_0_weight

    weight = q8_0_weight(48, 128, seed=4)
    linear = PackedLinear(weight, dtype=torch.bfloat16)
    assert linear.uses_block_codes and linear.weight is not None
    monkeypatch.setattr(linear_module, "MAX_BLOCK_CODE_ROWS_BF16_AMX", 4)
    monkeypatch.setattr(linear_module, "MAX_AMX_LINEAR_ROWS", 8)
    codes, w = linear.codes, weight.bfloat16()
    assert codes is not None
    g = torch.Generator().manual_seed(6)
    for rows in (3, 8, 20):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        if rows <= 4:
            expected = torch.ops.kvmesh.block_code_linear(
                x, codes.codes, codes.scales, codes.offsets, codes.out_features
            )
        elif rows <= 8:
            expected = torch.ops.kvmesh.amx_linear(x, w, None)
        else:
            expected = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        assert torch.equal(linear(x), expected)
