"""--quantization w8a8: codes-only projections on per-token int8 activations.

PackedLinear runs exactly the kernel's arithmetic (kernels/int8_reference.py)
up to ``MAX_W8A8_KERNEL_ROWS*`` rows and the weight-only paths above; models
(a float checkpoint quantized at load, a GGUF file's Q4_0/Q4_1/Q8_0 codes)
stay close to their weight-only int8 logits, and startup refuses w8a8 where
the C++ kernels are off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels.block_codes import quantize_int8
from kvmesh.kernels.int8_reference import w8a8_reference
from kvmesh.worker.gguf_weights import CODE_TYPES, block_codes
from kvmesh.worker.models import linear
from kvmesh.worker.models.linear import PackedLinear
from tests.worker.quant_accuracy import agreement

from .conftest import make_tiny_checkpoint
from .gguf_files import write_tiny_gguf
from .test_worker_model_loader import PROMPTS, _greedy, _our_logits
from .test_worker_quantized import PROJECTIONS_PER_LAYER, _runner

# Per-token int8 activations add about half a step of 127 (per row, of its
# largest |x|) to every input: for Gaussian rows a few tenths of a percent
# of the output, measured 0.3-0.6% here; the bound leaves room, not slack.
RELATIVE_TO_WEIGHT_ONLY = 0.015
# Through a tiny random model's layers the logits drift further: measured
# 3.6-6.2% (float32, --quantization int8 vs w8a8) and 6.7% (a GGUF file in
# bfloat16, weight-only vs w8a8). A kernel that dropped a term (the offsets,
# a row scale) is off by ~100%.
MODEL_RELATIVE_TO_WEIGHT_ONLY = 0.1


@pytest.fixture
def every_row_w8a8(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 rows too (served, they stop at MAX_W8A8_KERNEL_ROWS_BF16)."""
    monkeypatch.setattr(linear, "MAX_W8A8_KERNEL_ROWS_BF16", 1 << 30)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_w8a8_projection_is_the_quantized_arithmetic_near_weight_only(
    kind, dtype, every_row_w8a8: None
) -> None:
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=g) * 0.1
    codes = block_codes(quantize(weight.numpy(), kind), kind, 37, 96).to_panels()
    bias = torch.randn(37, generator=g)
    w8a8 = PackedLinear.from_codes(codes, bias, dtype, int8_activations=True)
    weight_only = PackedLinear.from_codes(codes, bias, dtype)
    for rows in (1, 5, 16, 40):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        y = w8a8(x)
        assert y.dtype == dtype
        expected = (w8a8_reference(x, codes) + bias.double()).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)
        error = _relative(y, weight_only(x))
        assert 0 < error < RELATIVE_TO_WEIGHT_ONLY, (rows, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_past_the_limit_run_weight_only(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    monkeypatch.setattr(linear, "MAX_W8A8_KERNEL_ROWS", 8)
    limit = 8 if dtype == torch.float32 else linear.MAX_W8A8_KERNEL_ROWS_BF16
    codes = quantize_int8(torch.randn(32, 64)).to_panels()
    w8a8 = PackedLinear.from_codes(codes, None, dtype, int8_activations=True)
    weight_only = PackedLinear.from_codes(codes, None, dtype)
    x = torch.randn(limit + 1, 64).to(dtype)
    assert torch.equal(w8a8(x), weight_only(x))
    assert not torch.equal(w8a8(x[:limit]), weight_only(x[:limit]))


def test_w8a8_model_stays_near_its_int8_logits(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    w8a8, int8 = _runner(tmp_path / "ckpt", "w8a8"), _runner(tmp_path / "ckpt", "int8")
    assert w8a8.model_config.weights_description == "w8a8"
    packed = [p for layer in w8a8.model.layers for p in (layer._packed or {}).values()]
    assert len(packed) == PROJECTIONS_PER_LAYER * w8a8.model_config.num_layers
    assert all(p.codes_only and p._int8_activations for p in packed)
    for prompt in PROMPTS:
        error = _relative(_our_logits(w8a8, prompt), _our_logits(int8, prompt))
        assert 0 < error < MODEL_RELATIVE_TO_WEIGHT_ONLY, error
    # Random tiny weights make near-ties common; a floor that can still fail.
    assert agreement(_greedy(int8), _greedy(w8a8)) >= 0.5


def test_w8a8_runs_a_gguf_files_codes(tmp_path: Path, every_row_w8a8: None) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32, True)
    named, _ = write_tiny_gguf(tmp_path / "ckpt", tmp_path)
    w8a8, weight_only = _runner(named, "w8a8", "bfloat16"), _runner(named, None, "bfloat16")
    assert w8a8.model_config.weights_description == "gguf+w8a8"
    assert all(p._int8_activations for layer in w8a8.model.layers for p in layer._packed.values())
    error = _relative(_our_logits(w8a8, PROMPTS[1]), _our_logits(weight_only, PROMPTS[1]))
    assert 0 < error < MODEL_RELATIVE_TO_WEIGHT_ONLY, error


def test_w8a8_is_refused_without_the_cpp_kernels(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    runner = _runner(tmp_path / "ckpt", "w8a8")
    with pytest.raises(ValueError, match="w8a8 needs kvmesh's C\\+\\+ CPU kernels"):
        runner.model.pack_weights(use_onednn=False, use_native=False)
