"""GGUF blocks as codes, int8 quantization, and codes-only projections against references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvmesh.kernels import native
from kvmesh.kernels.block_codes import BLOCK, find_block_codes, quantize_int8
from kvmesh.worker.gguf_weights import CODE_TYPES, _unpermute_rows, block_codes
from kvmesh.worker.models.linear import (
    MAX_BLOCK_CODE_ROWS,
    MAX_CODES_ONLY_KERNEL_ROWS,
    MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX,
    PackedLinear,
)
from kvmesh.worker.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def _gguf_tensor(kind: GGMLQuantizationType, rows: int = 37, cols: int = 96):
    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.1
    data = quantize(weight, kind)
    return data, torch.from_numpy(dequantize(data, kind).reshape(rows, cols).copy())


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
def test_blocks_become_codes_of_ggufs_own_dequantized_values(kind) -> None:
    data, expected = _gguf_tensor(kind)
    codes = block_codes(data, kind, *expected.shape)
    assert codes.codes.dtype == torch.uint8
    # Bit for bit, but for the sign of zero: Q4_0's d * (8 - 8) is -0.0 where its
    # scale is negative, 8 * d - 8 * d is +0.0 (equal as numbers, and as terms of a sum).
    for rebuilt in (codes.dequantize(), codes.to_panels().dequantize()):
        same_bits = rebuilt.view(torch.int32) == expected.view(torch.int32)
        both_zero = (rebuilt == 0) & (expected == 0)
        assert bool((same_bits | both_zero).all())
        if kind != GGMLQuantizationType.Q4_0:
            assert bool(same_bits.all())
    assert torch.equal(codes.embedding(torch.tensor([5, 0, 5])), expected[[5, 0, 5]])


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
def test_dequantized_gguf_weights_are_found_to_be_block_codes(kind) -> None:
    # A float32 checkpoint converted from a GGUF of any of these types runs its
    # small batches on the kernel too (kernels/block_codes.py tries every layout).
    _, weight = _gguf_tensor(kind)
    codes = find_block_codes(weight)
    assert codes is not None and torch.equal(codes.dequantize(), weight)


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize(
    "rows", [1, 7, MAX_BLOCK_CODE_ROWS + 1, MAX_CODES_ONLY_KERNEL_ROWS + 1, 300]
)
def test_codes_only_projection_matches_the_dense_one(kind, rows: int) -> None:
    data, weight = _gguf_tensor(kind)
    bias = torch.randn(weight.shape[0])
    x = torch.randn(rows, weight.shape[1])
    linear = PackedLinear.from_codes(
        block_codes(data, kind, *weight.shape).to_panels(), bias, torch.float32
    )
    assert linear.codes_only and linear.weight is None
    reference = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(linear(x), reference, rtol=1e-5, atol=1e-5)
    if rows > MAX_CODES_ONLY_KERNEL_ROWS:
        # Prefill rebuilds the weight: bit for bit oneDNN over the dense weight.
        dense = PackedLinear(weight, bias, use_block_codes=False)
        assert torch.equal(linear(x), dense(x))


def test_bfloat16_compute_from_codes() -> None:
    data, weight = _gguf_tensor(GGMLQuantizationType.Q4_1)
    linear = PackedLinear.from_codes(
        block_codes(data, GGMLQuantizationType.Q4_1, *weight.shape).to_panels(),
        None,
        torch.bfloat16,
    )
    # Past each limit: rebuilt + oneDNN at every level, amx's included.
    for rows in (3, 64, MAX_CODES_ONLY_KERNEL_ROWS + 1, MAX_CODES_ONLY_KERNEL_ROWS_BF16_AMX + 1):
        x = torch.randn(rows, weight.shape[1]).bfloat16()
        y = linear(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.float() @ weight.T, rtol=2e-2, atol=2e-2)


def test_unpermute_is_transformers_reverse_permutation() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = torch.randn(6 * 16, 64)
    reverse = LlamaTensorProcessor()._reverse_permute_weights
    for heads in (6, 2):
        expected = torch.from_numpy(reverse(weight.numpy(), heads, heads))
        assert torch.equal(_unpermute_rows(weight, heads), expected)
        codes = quantize_int8(weight)
        assert torch.equal(
            _unpermute_rows(codes, heads).dequantize(),
            codes.dequantize()[torch.from_numpy(reverse(np.arange(weight.shape[0]), heads, heads))],
        )


def test_int8_quantization_error_is_half_a_step() -> None:
    generator = torch.Generator().manual_seed(0)
    # Rows from 1e-6 to 0.1 in size: the small ones have float16-subnormal
    # scales, where a scale rounded to nearest could come out smaller than
    # max |w| / 127 and clamp the largest codes.
    sizes = torch.logspace(-6, -1, 48).unsqueeze(1)
    weight = torch.randn(48, 128, generator=generator) * sizes
    codes = quantize_int8(weight)
    scales = codes.scales.repeat_interleave(BLOCK, dim=1)
    assert torch.equal(scales, scales.half().float())  # Q8_0's float16 scale
    assert int(codes.codes.min()) >= 1 and int(codes.codes.max()) <= 255  # -127..127 + 128
    error = (codes.dequantize() - weight).abs()
    # Half a step (the float32 division and product add an ulp or two).
    assert bool((error <= scales * (0.5 + 2**-20)).all())
    assert float(error.max()) > 0  # it did quantize
    # The largest weight of every block gets a code of 127 or 126, never more.
    assert int((codes.codes.int() - 128).abs().max()) == 127


def test_gguf_names_map_to_hugging_face_names() -> None:
    hf_name = LlamaForCausalLM.declaration.gguf_name
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
