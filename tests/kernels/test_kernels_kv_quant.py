"""The quantized KV cache (--kv-cache-dtype, kernels/kv_quant.py) in every backend.

Each backend's cache write must produce exactly the codes and scales of
``kv_quant.quantize``, and its attention over the quantized cache must match
the float32 reference over the same cache dequantized (the kernels dequantize
in registers; only the order of sums differs). Never-written slots hold NaN
scales, so a kernel that reads one poisons its output.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from kvmesh.kernels import batch_invariant, kv_quant, native
from kvmesh.kernels.backend import AttentionBackend
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.registry import select_attention_backend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from kvmesh.kernels.triton_backend import TritonAttentionBackend
from kvmesh.kernels.triton_cache import _e4m3_bits
from kvmesh.services.runtime.config import KV_CACHE_DTYPES
from tests.kernels.paged_batch import (
    SCENARIOS,
    PagedBatch,
    free_out_of_window,
    make_paged_batch,
)

FORMATS = [kv_quant.INT8, kv_quant.FP8_E4M3, kv_quant.FP8_E5M2]


@triton.jit
def _convert_e4m3(x_ptr, out_ptr, N: tl.constexpr) -> None:
    """The Triton cache writer's float8_e4m3fn bits of N floats."""
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _e4m3_bits(tl.load(x_ptr + i)))


def quantized_batch(batch: PagedBatch, fmt: kv_quant.KVCacheFormat) -> PagedBatch:
    """``batch`` with its caches as ``fmt`` pages: written slots quantized, the
    others NaN-scaled."""

    def pages(cache: torch.Tensor) -> torch.Tensor:
        codes = kv_quant.allocate_pages(fmt, *cache.shape)
        values, scales = kv_quant.quantize(torch.nan_to_num(cache.float()), fmt)
        codes.copy_(values)
        written = ~torch.isnan(cache.float()).any(dim=-1)
        kv_quant.cache_scales(codes).copy_(torch.where(written, scales, float("nan")))
        return codes

    return replace(batch, k_cache=pages(batch.k_cache), v_cache=pages(batch.v_cache))


def dequantized_reference(batch: PagedBatch) -> PagedBatch:
    """The float32 batch a quantized one stands for: caches dequantized, new rows
    quantized and back (what the cache will hold once they are written)."""
    fmt = kv_quant.format_of(batch.k_cache)

    def round_trip(rows: torch.Tensor) -> torch.Tensor:
        return kv_quant.dequantize(*kv_quant.quantize(rows, fmt), torch.float32)

    return replace(
        batch,
        query=batch.query.float(),
        key=round_trip(batch.key),
        value=round_trip(batch.value),
        k_cache=kv_quant.dequantize_cache(batch.k_cache, torch.float32),
        v_cache=kv_quant.dequantize_cache(batch.v_cache, torch.float32),
    )


def fresh(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a batch's caches, pages and all."""

    def copy(cache: torch.Tensor) -> torch.Tensor:
        out = kv_quant.allocate_pages(kv_quant.format_of(cache), *cache.shape)
        kv_quant.cache_pages(out).copy_(kv_quant.cache_pages(cache))
        return out

    return copy(batch.k_cache), copy(batch.v_cache)


def run_quantized(
    backend: AttentionBackend, batch: PagedBatch, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, k_cache, v_cache) after the backend wrote the new rows and attended."""
    k_cache, v_cache = fresh(batch)
    metadata = batch.metadata(backend)
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    out = backend.forward(
        batch.query, k_cache, v_cache, metadata, batch.scale, sliding_window=sliding_window
    )
    return out, k_cache, v_cache


def reference_output(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    ref = dequantized_reference(batch)
    k_cache, v_cache = ref.fresh_caches()
    backend = TorchReferenceBackend()
    backend.write_kv_cache(ref.key, ref.value, k_cache, v_cache, ref.slot_mapping)
    return backend.forward(
        ref.query, k_cache, v_cache, ref.metadata(backend), ref.scale, sliding_window=sliding_window
    )


def assert_written_exactly(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    fmt = kv_quant.format_of(k_cache)
    slots = batch.slot_mapping
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for rows, cache in ((batch.key, k_cache), (batch.value, v_cache)):
        codes, scales = kv_quant.quantize(rows, fmt)
        assert torch.equal(cache[blocks, offsets].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(kv_quant.cache_scales(cache)[blocks, offsets], scales)


def backends() -> list[AttentionBackend]:
    found: list[AttentionBackend] = [TorchReferenceBackend(), CpuAttentionBackend()]
    if native.unavailable_reason() is None:
        found.append(NativeCpuAttentionBackend())
    return found


def check(backend: AttentionBackend, batch: PagedBatch, window: int | None = None) -> None:
    out, k_cache, v_cache = run_quantized(backend, batch, window)
    assert_written_exactly(batch, k_cache, v_cache)
    assert not torch.isnan(out).any(), "read a never-written (NaN) slot"
    expected = reference_output(batch, window)
    bf16 = batch.query.dtype == torch.bfloat16
    # The kernels dequantize exactly (codes times scale in float32); the
    # difference is the order of sums, and for bfloat16 the output's rounding
    # (and, at AVX512-BF16, the probabilities' before P V).
    tolerance = 2**-6 if bf16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scenario", ["decodes_ragged", "mixed_any_order"])
@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_quantized_cache_matches_reference(
    backend: AttentionBackend, scenario: str, fmt: kv_quant.KVCacheFormat
) -> None:
    # head_dim 32: the C++ kernel's generic per-head path (the torch paths have one).
    shapes = [(64, (9, 3))] + ([(32, (4, 4))] if backend.name == "cpu_native" else [])
    for head_dim, heads in shapes:
        batch = make_paged_batch(
            SCENARIOS[scenario],
            num_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=head_dim,
            block_size=16,
        )
        check(backend, quantized_batch(batch, fmt))


@pytest.mark.parametrize("fmt", [kv_quant.INT8, kv_quant.FP8_E4M3], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_long_decodes_split_into_runs(
    dtype: torch.dtype, fmt: kv_quant.KVCacheFormat
) -> None:
    """Runs (split-K) over long quantized contexts, GQA groups of 3 and 8,
    head_dim 128, blocks of 8 (tiles shorter than 16 tokens), bfloat16 queries."""
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    for heads, head_dim, block_size in (((9, 3), 64, 16), ((8, 1), 128, 8)):
        batch = make_paged_batch(
            [(700, 1), (0, 1), (300, 1)],
            num_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
        )
        check(NativeCpuAttentionBackend(), quantized_batch(batch, fmt))


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_quantized_cache_with_sliding_window(backend: AttentionBackend) -> None:
    """A window's freed blocks (NaN, never read) before each query's window."""
    batch = make_paged_batch(
        [(90, 1), (0, 50), (33, 1), (48, 40)],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
    )
    windowed = free_out_of_window(batch, 21)
    check(backend, quantized_batch(windowed, kv_quant.INT8), window=21)


def test_quantize_definition() -> None:
    """Codes round to nearest within the format's range; a zero row has scale 0."""
    rows = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.0118, 2.0]])
    codes, scales = kv_quant.quantize(rows, kv_quant.INT8)
    assert codes.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0], [127, 64, -0, 85]]
    assert scales.tolist() == pytest.approx([1 / 127, 0.0, 3 / 127])
    codes, scales = kv_quant.quantize(rows, kv_quant.FP8_E4M3)
    assert codes.float().abs().amax(dim=-1).tolist() == [448.0, 0.0, 448.0]
    back = kv_quant.dequantize(codes, scales, torch.float32)
    torch.testing.assert_close(back, rows, atol=0.0, rtol=2**-4)


def test_pages_hold_codes_then_scales() -> None:
    """A page is the block's codes, then its float32 scales: the store's bytes."""
    cache = kv_quant.allocate_pages(kv_quant.INT8, 3, 4, 2, 8)
    assert cache.shape == (3, 4, 2, 8) and cache.stride(0) == kv_quant.page_bytes(4, 2, 8)
    assert kv_quant.page_bytes(4, 2, 8) == 4 * 2 * 8 + 4 * 2 * 4
    cache[1, 2, 1] = 7
    kv_quant.cache_scales(cache)[1, 2, 1] = 0.5
    page = kv_quant.cache_pages(cache)[1]
    assert page[(2 * 2 + 1) * 8 : (2 * 2 + 1) * 8 + 8].tolist() == [7] * 8
    assert page[64:].view(torch.float32).tolist() == [0, 0, 0, 0, 0, 0.5, 0, 0]
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported"):
        kv_quant.resolve("int4")
    assert kv_quant.resolve("fp8") is kv_quant.FP8_E4M3 and kv_quant.resolve("auto") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decodes_and_writes_run_in_cpp(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No torch fallback: the C++ write quantizes, C++ decode and (where the
    level runs it for the dtype) prefill attention dequantize."""
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())

    def fell_back(*args: object) -> None:
        raise AssertionError("a quantized cache fell back to the torch path")

    monkeypatch.setattr(CpuAttentionBackend, "_decode", staticmethod(fell_back))
    monkeypatch.setattr(kv_quant, "write_rows", fell_back)
    if dtype in native.prefill_attention_dtypes():
        monkeypatch.setattr(CpuAttentionBackend, "_prefill", classmethod(fell_back))
    batch = make_paged_batch(
        SCENARIOS["mixed_any_order"],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    for fmt in FORMATS:
        check(NativeCpuAttentionBackend(), quantized_batch(batch, fmt))


def test_batch_invariant_mode_reads_a_quantized_cache() -> None:
    """In the mode, a chunk's rows over a quantized prefix equal the same
    positions as one-token decodes, bit for bit, and the reference within tolerance."""
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    prefix, chunk = 300, 24
    batch = quantized_batch(
        make_paged_batch(
            [(prefix, chunk)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16
        ),
        kv_quant.INT8,
    )
    with batch_invariant.forced(True):
        backend = select_attention_backend("cpu")
        whole, k_cache, v_cache = run_quantized(backend, batch)
        for i in (0, chunk - 1):
            one = backend.build_metadata(
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                context_lens=torch.tensor([prefix + i + 1], dtype=torch.int32),
                block_tables=batch.block_tables,
                slot_mapping=batch.slot_mapping[i : i + 1],
            )
            row = backend.forward(batch.query[i : i + 1], k_cache, v_cache, one, batch.scale)
            assert torch.equal(row[0], whole[i]), i
    torch.testing.assert_close(whole, reference_output(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", [kv_quant.INT8, kv_quant.FP8_E4M3], ids=lambda f: f.name)
def test_triton_writes_and_reads_a_quantized_cache(fmt: kv_quant.KVCacheFormat) -> None:
    """Under TRITON_INTERPRET (tiny shapes): the same codes and scales, the
    reference's attention, decodes and prefill chunks, with a window too."""
    if not TritonAttentionBackend.supports_device(torch.device("cpu")):
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET")
    batch = make_paged_batch(
        [(5, 1), (0, 7), (20, 1), (14, 3)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
    )
    check(TritonAttentionBackend(), quantized_batch(batch, fmt))
    windowed = free_out_of_window(batch, 6)
    check(TritonAttentionBackend(), quantized_batch(windowed, fmt), window=6)


def test_backends_refuse_what_they_do_not_read() -> None:
    assert TritonAttentionBackend.kv_cache_unsupported_reason("fp8_e5m2") is not None
    assert "fp8_e5m2" in TritonAttentionBackend.kv_cache_unsupported_reason("fp8_e5m2")
    for name in ("auto", "int8", "fp8", "fp8_e4m3"):
        assert TritonAttentionBackend.kv_cache_unsupported_reason(name) is None
    for backend in (NativeCpuAttentionBackend, CpuAttentionBackend, TorchReferenceBackend):
        for name in KV_CACHE_DTYPES:
            assert backend.kv_cache_unsupported_reason(name) is None


def test_triton_e4m3_bits_round_as_torch() -> None:
    """The Triton writer's float8_e4m3fn bits, over normals, subnormals, ties and
    the range's end, equal torch's ``.to()`` bits."""
    if not TritonAttentionBackend.supports_device(torch.device("cpu")):
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET")
    grid = torch.cat([2.0 ** torch.linspace(-12, 8.8, 1500), torch.arange(0, 448.5, 0.5)])
    codes = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes)].sort().values
    ties = (values[:-1] + values[1:]) / 2  # halfway between neighbours: to even
    x = torch.cat([grid, -grid, ties, -ties, values]).float()
    x = torch.cat([x, torch.zeros(4096 - x.numel())]) if x.numel() < 4096 else x[:4096]
    out = torch.empty(4096, dtype=torch.uint8)
    _convert_e4m3[(1,)](x, out, N=4096)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))
