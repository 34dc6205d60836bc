"""GGUF blocks run as they are: the K-quant quantizer, the exact rebuild, the kernel.

The quantizer's bytes must be what the ``gguf`` package dequantizes to the
quantizer's own values; the C++ rebuild must equal ``gguf``'s dequantization
bit for bit for every type; the kernel and the tiled prefill path must equal
"dequantize, then matmul" within float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvmesh.kernels import native
from kvmesh.kernels.ggml_blocks import BLOCK_FORMATS, GGMLRows, Segment
from kvmesh.kernels.ggml_quantize import quantize, reference_dequantize
from kvmesh.worker.models import ggml_linear
from kvmesh.worker.models.ggml_linear import MAX_GGML_KERNEL_ROWS, GGMLLinear

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
needs_kernels = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=str(native.unavailable_reason())
)


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :256] = np.abs(w[0, :256])  # a super-block with no negative weight (min 0)
    w[1, :256] = 0.0  # an all-zero super-block (zero scales)
    w[2, :32] *= 40  # one outlier sub-block dominating its super-block's scale
    return w


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda k: k.name)
def test_quantizer_bytes_dequantize_to_its_values_block_by_block(kind) -> None:
    weight = _weights(24, 768)
    data = quantize(weight, kind)
    weights, nbytes = BLOCK_FORMATS[kind]
    assert data.shape == (24, 768 // weights * nbytes)
    blocks = data.reshape(-1, nbytes)
    want = reference_dequantize(weight, kind).reshape(-1, weights)
    for index, block in enumerate(blocks):
        got = dequantize(block[None], kind).reshape(-1)
        np.testing.assert_array_equal(got, want[index], err_msg=f"block {index}")
    # And the values are a quantization of the weights (error well under a step).
    error = np.abs(want.reshape(weight.shape) - weight).mean() / np.abs(weight).mean()
    assert error < {Q.Q4_K: 0.12, Q.Q5_K: 0.06, Q.Q6_K: 0.03}[kind]


def _random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of random bytes with finite float16 scales (every code pattern)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = BLOCK_FORMATS[kind]
    raw = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    halves = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
    for offset in halves.get(kind, (0,)):
        scale = (rng.standard_normal((rows, cols // weights, 1)) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
def test_native_rebuild_is_gguf_dequantization_bit_for_bit(kind) -> None:
    raw = _random_blocks(kind, 19, 512, seed=int(kind))
    want = dequantize(raw, kind).reshape(19, 512)
    got = torch.ops.kvmesh.ggml_dequantize(torch.from_numpy(raw), int(kind), 512)
    np.testing.assert_array_equal(got.numpy(), want)


@needs_kernels
@pytest.mark.parametrize("kind", list(BLOCK_FORMATS), ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 8, MAX_GGML_KERNEL_ROWS])
def test_kernel_equals_dequantize_then_matmul(kind, rows: int) -> None:
    out_features = 37  # not a multiple of the kernel's row group
    raw = _random_blocks(kind, out_features, 768, seed=rows)
    weight = torch.from_numpy(dequantize(raw, kind).reshape(out_features, 768).copy())
    x = torch.randn(rows, 768)
    got = torch.ops.kvmesh.ggml_linear(x, [torch.from_numpy(raw)], [int(kind)])
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _mixed_rows() -> tuple[GGMLRows, torch.Tensor]:
    """q and k in Q4_K, v in Q6_K (a Q4_K_M file's fused qkv), as one weight."""
    parts = []
    for seed, (kind, rows) in enumerate(((Q.Q4_K, 40), (Q.Q4_K, 8), (Q.Q6_K, 8))):
        weight = _weights(rows, 512, seed)
        parts.append(GGMLRows.from_file(quantize(weight, kind), kind, rows, 512))
    fused = GGMLRows.cat(parts)
    dense = torch.cat(
        [
            torch.from_numpy(reference_dequantize(_weights(r, 512, s), k))
            for s, (k, r) in enumerate(((Q.Q4_K, 40), (Q.Q4_K, 8), (Q.Q6_K, 8)))
        ]
    )
    return fused, dense


def test_mixed_rows_join_by_type_and_slice_on_blocks() -> None:
    fused, dense = _mixed_rows()
    assert fused.kinds == (Q.Q4_K, Q.Q6_K)  # the two Q4_K pieces merge
    assert fused.shape == (56, 512)
    assert fused.nbytes == 48 * 2 * 144 + 8 * 2 * 210  # the file's bytes, nothing more
    torch.testing.assert_close(fused.dequantize(), dense, rtol=0, atol=0)
    single = GGMLRows((fused.segments[0],), 512)
    torch.testing.assert_close(single[5:9].dequantize(), dense[5:9], rtol=0, atol=0)
    torch.testing.assert_close(single[:, 256:].dequantize(), dense[:48, 256:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="blocks"):
        single[:, 32:256]
    ids = torch.tensor([[3, 0], [47, 3]])
    torch.testing.assert_close(single.embedding(ids), dense[ids], rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_runs_kernel_for_decode_and_tiles_for_prefill(monkeypatch, dtype) -> None:
    fused, dense = _mixed_rows()
    bias = torch.randn(56)
    # Tiles of 16 rows: a prefill crosses the segment boundary inside a tile.
    monkeypatch.setattr(ggml_linear, "TILE_FLOATS", 16 * 512)
    projection = GGMLLinear(fused, bias, dtype)
    assert projection.codes_only and projection.uses_block_codes
    assert projection.resident_bytes == fused.nbytes
    for rows in (1, MAX_GGML_KERNEL_ROWS, MAX_GGML_KERNEL_ROWS + 1, 200):
        x = torch.randn(rows, 512).to(dtype)
        want = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
        got = projection(x)
        assert got.dtype == dtype and got.shape == (rows, 56)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max())
        )
    torch.testing.assert_close(projection.dense_weight().float(), dense.to(dtype).float())


def test_segment_dequantize_without_kernels_is_gguf_s(monkeypatch) -> None:
    raw = _random_blocks(Q.Q5_K, 4, 256, seed=3)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "off for this test")
    got = Segment(Q.Q5_K, torch.from_numpy(raw)).dequantize(256)
    np.testing.assert_array_equal(got.numpy(), dequantize(raw, Q.Q5_K).reshape(4, 256))
