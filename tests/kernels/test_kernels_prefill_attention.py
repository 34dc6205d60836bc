"""Prefill chunks in C++ (kernels/csrc/prefill_attention_cpu.cpp), bfloat16 and float32.

The ``cpu_native`` backend's prefill chunks against the float32 reference
(kernels/reference.py) over the same values, and against torch's own SDPA path
(``cpu``). The loaded level decides which products run: bfloat16 on AMX tiles
at ``amx``, on vdpbf16ps at ``avx512_bf16`` (``KVMESH_CPU_ISA=avx512_bf16`` runs
the latter on an AMX machine); float32 on FMAs over AVX-512 or AVX2 registers
from ``avx2`` up (``KVMESH_CPU_ISA=avx2`` runs the AVX2 form). Each dtype's
tests are skipped, with the reason, where the loaded ops do not take it
(bfloat16 without AVX512-BF16; both at generic).
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from kvmesh.services.runtime.cpu_features import CpuFeatures
from tests.kernels.paged_batch import PagedBatch, make_paged_batch, run_backend


def _skip_reason(dtype: torch.dtype) -> str | None:
    if (reason := native.unavailable_reason()) is not None:
        return f"native kernels unavailable: {reason}"
    if dtype not in native.prefill_attention_dtypes():
        return (
            f"loaded level {native.loaded_level().name} has no {dtype} prefill attention "
            f"({CpuFeatures.detect().model_name})"
        )
    return None


def _dtype_param(dtype: torch.dtype) -> object:
    reason = _skip_reason(dtype)
    return pytest.param(
        dtype,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(reason is not None, reason=str(reason)),
    )


DTYPES = [_dtype_param(torch.bfloat16), _dtype_param(torch.float32)]
BF16 = [_dtype_param(torch.bfloat16)]

# bfloat16: the kernel rounds the probabilities to bfloat16 before P V (as
# torch's bfloat16 SDPA does) and the output once: errors of a few bfloat16
# ulps of the O(1) outputs (measured on these batches: max |error| ~0.008, the
# same as torch's bfloat16 SDPA path on them). float32: only the order of the
# sums and the exp polynomial differ (measured: max |error| ~7e-7, as torch's
# float32 SDPA path).
TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 1e-5}

GQA_SHAPES = [(9, 3), (4, 4), (8, 1), (12, 3)]  # (num_heads, num_kv_heads)
# (num_cached_tokens, num_new_tokens) per sequence.
PREFILL_BATCHES = {
    # Fresh prompts: shorter than one 16-row tile, ragged, past one 64-key block.
    "fresh_short": [(0, 7)],
    "fresh_ragged": [(0, 21), (0, 100)],
    # Chunks on cached prefixes ending mid-block; the diagonal crosses key blocks.
    "chunk_on_prefix": [(19, 13), (37, 70)],
    "long_prefix_short_chunk": [(250, 5)],
    # Prefill chunks among decodes, in any order.
    "mixed_with_decodes": [(9, 1), (0, 33), (40, 1), (12, 17), (1, 1), (0, 2), (130, 66)],
}


def assert_matches_reference(batch: PagedBatch) -> torch.Tensor:
    expected = run_backend(TorchReferenceBackend(), batch.to_float32())
    actual = run_backend(NativeCpuAttentionBackend(), batch)
    assert actual.dtype == batch.query.dtype
    assert not torch.isnan(actual).any(), "read a never-written (NaN) cache slot"
    tolerance = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)
    return actual


@pytest.fixture
def no_torch_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if any prefill chunk takes the torch SDPA path."""

    def torch_prefill(*args: object) -> None:
        raise AssertionError("a prefill chunk fell back to torch SDPA")

    monkeypatch.setattr(CpuAttentionBackend, "_prefill_chunk", staticmethod(torch_prefill))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch_name", list(PREFILL_BATCHES))
def test_prefill_matches_reference(
    batch_name: str,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    no_torch_prefill: None,
) -> None:
    batch = make_paged_batch(
        PREFILL_BATCHES[batch_name],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_head_sizes_off_the_64_grid(
    head_dim: int, dtype: torch.dtype, no_torch_prefill: None
) -> None:
    """Head sizes whose output is not whole groups of 64 dims (the vector path's
    2-tile tail) and the largest one, past one 256-key softmax step."""
    batch = make_paged_batch(
        [(37, 70), (0, 300), (5, 1)],
        num_heads=6,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", BF16)
@pytest.mark.parametrize("seed", range(3))
def test_long_ragged_chunks_no_less_accurate_than_torch_sdpa(seed: int, dtype: torch.dtype) -> None:
    """Several chunks of hundreds of tokens, on prefixes or not: the mean error
    against float32 is no larger than that of torch's bfloat16 SDPA path."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [
        (int(torch.randint(0, 300, ()).item()) * (i % 2), int(torch.randint(2, 400, ()).item()))
        for i in range(4)
    ]
    batch = make_paged_batch(
        [*seqs, (77, 1)],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=seed + int(torch.randint(0, 1000, (), generator=generator).item()),
    )
    expected = run_backend(TorchReferenceBackend(), batch.to_float32())
    actual = assert_matches_reference(batch)
    torch_sdpa = run_backend(CpuAttentionBackend(), batch)
    native_error = (actual.float() - expected).abs().mean()
    sdpa_error = (torch_sdpa.float() - expected).abs().mean()
    assert native_error <= 1.1 * sdpa_error, (native_error, sdpa_error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_do_not_overflow(dtype: torch.dtype, no_torch_prefill: None) -> None:
    """The running max is subtracted before exp: scores of ~1e4 stay finite."""
    batch = make_paged_batch(
        [(40, 30), (0, 20)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    big = batch.with_query_scaled(1000.0)
    actual = run_backend(NativeCpuAttentionBackend(), big)
    expected = run_backend(TorchReferenceBackend(), big.to_float32())
    assert torch.isfinite(actual).all()
    # Scores of ~1e4 leave ~1e-3 of relative error in float32 scores.
    tolerance = max(TOLERANCE[dtype], 1e-3)
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    """Each 16-row item is computed the same way whichever thread takes it."""
    batch = make_paged_batch(
        [(0, 200), (50, 90)],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_backend(NativeCpuAttentionBackend(), batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, run_backend(NativeCpuAttentionBackend(), batch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_other_head_sizes_take_the_torch_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head sizes that are not whole 32-dim operand rows go to torch's SDPA per
    chunk (never the op) and still give the reference."""
    torch_chunks = []
    torch_prefill_chunk = CpuAttentionBackend._prefill_chunk

    def counted(*args: object) -> None:
        torch_chunks.append(args)
        torch_prefill_chunk(*args)

    monkeypatch.setattr(CpuAttentionBackend, "_prefill_chunk", staticmethod(counted))
    for head_dim in (80, 16):
        torch_chunks.clear()
        batch = make_paged_batch(
            [(19, 13), (0, 21)],
            num_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
        )
        expected = run_backend(TorchReferenceBackend(), batch.to_float32())
        actual = run_backend(NativeCpuAttentionBackend(), batch)
        assert len(torch_chunks) == 2, head_dim
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_the_chunks_rows_are_written(dtype: torch.dtype) -> None:
    """Rows outside every chunk (here: between two chunks) keep what ``out`` held."""
    batch = make_paged_batch(
        [(0, 20), (5, 1), (3, 30)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    k_cache, v_cache = batch.fresh_caches()
    backend = NativeCpuAttentionBackend()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    plan = batch.metadata(backend).plan
    out = torch.full_like(batch.query, 7.0)
    torch.ops.kvmesh.paged_prefill_attention(
        out,
        batch.query,
        k_cache,
        v_cache,
        plan.prefill_block_tables,
        plan.prefill_query_starts,
        plan.prefill_query_lens,
        plan.prefill_context_lens,
        batch.scale,
    )
    assert torch.equal(out[20], torch.full_like(out[20], 7.0))
    assert not torch.isnan(out).any()


def _prefill_args() -> dict[str, torch.Tensor]:
    bf16 = torch.bfloat16
    return {
        "out": torch.zeros(20, 4, 64, dtype=bf16),
        "query": torch.randn(20, 4, 64, dtype=bf16),
        "key_cache": torch.randn(4, 16, 2, 64, dtype=bf16),
        "value_cache": torch.randn(4, 16, 2, 64, dtype=bf16),
        "block_tables": torch.tensor([[0, 1], [2, 3]]),
        "query_starts": torch.tensor([0, 12]),
        "query_lens": torch.tensor([12, 8]),
        "context_lens": torch.tensor([20, 8]),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_tables": torch.tensor([[0, 9], [2, 3]])}, "block id 9 out of range"),
        ({"context_lens": torch.tensor([20, 7])}, "context length 7"),
        ({"context_lens": torch.tensor([33, 8])}, "context length 33"),
        ({"query_starts": torch.tensor([0, 13])}, "chunk rows out of range"),
        ({"query_lens": torch.tensor([12, 8], dtype=torch.int32)}, "int64"),
        ({"query": torch.randn(20, 4, 64)}, "must all be Float, not BFloat16"),
        ({"query": torch.randn(20, 4, 64, dtype=torch.float16)}, "bfloat16 or float32"),
        ({"key_cache": torch.randn(4, 16, 3, 64, dtype=torch.bfloat16)}, "differ in shape"),
        (
            {
                name: torch.randn(*shape, 80, dtype=torch.bfloat16)
                for name, shape in (
                    ("out", (20, 4)),
                    ("query", (20, 4)),
                    ("key_cache", (4, 16, 2)),
                    ("value_cache", (4, 16, 2)),
                )
            },
            "head_dim must be a multiple of 32",
        ),
    ],
)
@pytest.mark.skipif(_skip_reason(torch.bfloat16) is not None, reason="bfloat16 op absent")
def test_bad_inputs_raise_clear_errors(change: dict[str, torch.Tensor], message: str) -> None:
    args = {**_prefill_args(), **change}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvmesh.paged_prefill_attention(*args.values(), 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [0, 37])
def test_a_rows_output_does_not_depend_on_the_rows_after_it(
    prefix: int, dtype: torch.dtype
) -> None:
    """Bit for bit: the first rows of a chunk cut short come out as they do in
    the whole chunk, though the kernel stops each row tile's last Q K^T pass at
    a different key (the float32 path at the 16-key tile of the tile's last
    row, not its 64-key block): the keys past a row's limit add exact zeros."""
    whole = 200
    batch = make_paged_batch(
        [(prefix, whole)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype
    )
    backend = NativeCpuAttentionBackend()
    k_cache, v_cache = batch.fresh_caches()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)

    def attend(rows: int) -> torch.Tensor:
        out = torch.empty_like(batch.query[:rows])
        torch.ops.kvmesh.paged_prefill_attention(
            out,
            batch.query[:rows],
            k_cache,
            v_cache,
            batch.block_tables.long(),
            torch.tensor([0]),
            torch.tensor([rows]),
            torch.tensor([prefix + rows]),
            batch.scale,
        )
        return out

    full = attend(whole)
    for rows in (1, 15, 17, 50, 77, 130):
        assert torch.equal(attend(rows), full[:rows]), f"cut at {rows} rows"
