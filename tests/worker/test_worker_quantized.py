"""GGUF files loaded directly and --quantization int8, on tiny random checkpoints.

A GGUF's quantized projections must run from their codes alone and give the
very logits of a float32 checkpoint holding the dequantized weights; int8
must be exactly "the projections replaced by quantize_int8's weights".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels.block_codes import RowCodes, quantize_int8
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import linear
from kvmesh.worker.models.linear import MAX_CODES_ONLY_KERNEL_ROWS
from tests.worker.quant_accuracy import agreement

from .conftest import make_tiny_checkpoint
from .gguf_files import F16, Q8_0, write_tiny_gguf
from .test_worker_model_loader import PROMPTS, _greedy, _hf_logits, _our_logits

PROJECTIONS_PER_LAYER = 4  # fused qkv, o, fused gate/up, down
# Where a GGUF and its converted checkpoint take the same path, so equal logits
# bit for bit: both on the kernel (a short prompt; <= 12 rows even in bf16), both
# rebuilding/oneDNN (longer than MAX_CODES_ONLY_KERNEL_ROWS). In between the
# GGUF stays on the kernel while the converted one runs oneDNN (close, not equal).
SAME_PATH_PROMPTS = [PROMPTS[0], [(7 * i) % 128 for i in range(MAX_CODES_ONLY_KERNEL_ROWS + 12)]]


def _runner(folder: Path, quantization: str | None = None, dtype: str | None = None) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, dtype=dtype, quantization=quantization),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )


def _dense_projection_bytes(runner: ModelRunner) -> int:
    config = runner.model_config
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 2 * inter * hidden + inter * hidden
    return 4 * per_layer * config.num_layers


@pytest.mark.parametrize(
    ("tied", "embedding_type"), [(True, Q8_0), (False, F16)], ids=["tied-q8_0", "untied-f16"]
)
def test_gguf_runs_from_codes_with_the_logits_of_its_dequantized_weights(
    tmp_path: Path, tied: bool, embedding_type
) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32, tied)
    named, reference = write_tiny_gguf(tmp_path / "ckpt", tmp_path, embedding_type)
    ours, ref = _runner(named), _runner(reference)
    assert ours.model_config.gguf_file.endswith("tiny.gguf")
    sizes = ours.model.weight_bytes()
    layers = ours.model_config.num_layers
    # Every decoder projection (and a quantized LM head) holds codes only.
    assert sizes["codes_only_projections"] == PROJECTIONS_PER_LAYER * layers + (
        1 if embedding_type == Q8_0 or not tied else 0
    )
    assert (sizes["embedding_codes"] > 0) == (embedding_type == Q8_0)
    # The converted checkpoint finds the same codes (Q4_0, Q4_1, Q8_0): the same paths.
    assert ref.model.block_code_coverage() == ours.model.block_code_coverage()
    for prompt in SAME_PATH_PROMPTS:
        assert torch.equal(_our_logits(ours, prompt), _our_logits(ref, prompt))
    torch.testing.assert_close(
        _our_logits(ours, PROMPTS[1]), _our_logits(ref, PROMPTS[1]), rtol=1e-5, atol=1e-5
    )
    assert _greedy(ours) == _greedy(ref)
    # Packed again without oneDNN or C++ ops (KVMESH_DENSE_LINEAR's A/B): from the codes.
    expected = _our_logits(ref, PROMPTS[1])
    ours.model.pack_weights(use_onednn=False, use_native=False)
    assert ours.model.weight_bytes()["codes_only_projections"] == sizes["codes_only_projections"]
    torch.testing.assert_close(_our_logits(ours, PROMPTS[1]), expected, rtol=1e-4, atol=1e-4)


def test_gguf_in_bfloat16_equals_its_converted_checkpoint_in_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At the amx level codes-only bf16 rows stay on the kernel far longer; the
    # long prompt must reach the rebuild path there too (the KV cache here
    # holds 256 tokens).
    monkeypatch.setattr(linear, "MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX", MAX_CODES_ONLY_KERNEL_ROWS)
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32, True)
    named, reference = write_tiny_gguf(tmp_path / "ckpt", tmp_path)
    ours, ref = _runner(named, dtype="bfloat16"), _runner(reference, dtype="bfloat16")
    for prompt in SAME_PATH_PROMPTS:
        assert torch.equal(_our_logits(ours, prompt), _our_logits(ref, prompt))


def test_gguf_matches_transformers_on_the_dequantized_weights(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    named, reference = write_tiny_gguf(tmp_path / "ckpt", tmp_path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    ours = _runner(named)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            _our_logits(ours, prompt), _hf_logits(hf, prompt), rtol=1e-4, atol=1e-4
        )


def test_int8_is_the_checkpoint_with_int8_projections(tmp_path: Path) -> None:
    hf = make_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", torch.float32)
    ours = _runner(tmp_path / "ckpt", quantization="int8")
    assert ours.model_config.quantization == "int8"
    sizes = ours.model.weight_bytes()
    assert sizes["codes_only_projections"] == PROJECTIONS_PER_LAYER * ours.model_config.num_layers
    # 1 byte per weight plus a scale and an offset per 32 (no dense copy left).
    head = ours.model._packed_lm_head.resident_bytes
    assert sizes["projections"] - head <= 0.32 * _dense_projection_bytes(ours)
    float_tokens = _greedy(_runner(tmp_path / "ckpt"))
    # The reference: transformers with every decoder projection replaced by its int8 weights.
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if ".layers." in name and "proj" in name:
                param.copy_(quantize_int8(param).dequantize())
    for prompt in PROMPTS:
        torch.testing.assert_close(
            _our_logits(ours, prompt), _hf_logits(hf, prompt), rtol=1e-4, atol=1e-4
        )
    tokens = _greedy(ours)
    ours.model.pack_weights(use_onednn=False, use_native=False)  # from the codes kept
    torch.testing.assert_close(
        _our_logits(ours, PROMPTS[1]), _hf_logits(hf, PROMPTS[1]), rtol=1e-4, atol=1e-4
    )
    # Accuracy cost on a random tiny model (a floor that can fail). Its logits are
    # near-ties, so one flipped token moves this by up to 1/3: 20 of 36 tokens agreed
    # with scales rounded to nearest, 17 with scales rounded up. The default model's
    # cost is the real measure (test_worker_quantized_default_model.py: 100%).
    assert agreement(float_tokens, tokens) >= 0.4


def test_row_codes_slice_like_the_dense_weight() -> None:
    weight = torch.randn(40, 96)
    codes = quantize_int8(weight)
    dense = codes.dequantize()
    assert torch.equal(codes[8:24].dequantize(), dense[8:24])
    assert torch.equal(codes[:, 32:64].dequantize(), dense[:, 32:64])
    assert torch.equal(RowCodes.cat([codes[:8], codes[8:]]).dequantize(), dense)
    assert torch.equal(codes.to_panels().dequantize(), dense)
    with pytest.raises(ValueError, match="code blocks"):
        codes[:, 16:48]
