"""The C++ decode kernel computes what kernels/reference.py defines, and refuses bad input.

The ops are built on first use (or by ``make install``); a machine without a
compiler fails here rather than silently testing nothing.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_isa import all_levels
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from tests.kernels.paged_batch import SCENARIOS, PagedBatch, make_paged_batch, run_backend

# float32; the kernel sums in another order than the reference and uses a
# vectorized exp (glibc libmvec, within 4 ulp): differences are a few ulps of
# O(1) outputs.
ATOL = 1e-5
RTOL = 1e-5
# bfloat16 q/K/V: compared with the float32 reference over the same (bf16)
# values. The kernel computes in float32 too and rounds its output, so it may
# differ by that rounding (half a bf16 ulp: at most 2**-8 relative) plus the
# float32 differences above. With AVX512-BF16 the run path also rounds the
# probabilities to bfloat16 for P V (as the prefill kernel does): errors of a
# few bfloat16 ulps of the O(1) outputs (measured: max |error| ~0.004), the
# prefill tests' tolerance.
BF16_ROUNDS_P = native.unavailable_reason() is None and native.loaded_level().bf16_dot_products
BF16_RTOL = 2**-6 if BF16_ROUNDS_P else 2**-8
BF16_ATOL = 2**-6 if BF16_ROUNDS_P else ATOL

GQA_SHAPES = [(9, 3), (4, 4), (8, 1), (12, 3)]  # (num_heads, num_kv_heads)
# 64 and 128 take the register-accumulator specializations, 32 and 80 the generic loop
# (256, Gemma's, too: test_native_decode_head_dim_256 below).
HEAD_DIMS = [64, 128, 32, 80]


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    native.ensure_loaded()


def assert_matches_reference(batch: PagedBatch) -> torch.Tensor:
    """The native backend's output on ``batch`` against the float32 reference."""
    expected = run_backend(TorchReferenceBackend(), batch.to_float32())
    actual = run_backend(NativeCpuAttentionBackend(), batch)
    assert actual.dtype == batch.query.dtype
    assert not torch.isnan(actual).any(), "read a never-written (NaN) cache slot"
    bf16 = actual.dtype == torch.bfloat16
    torch.testing.assert_close(
        actual.float(),
        expected,
        atol=BF16_ATOL if bf16 else ATOL,
        rtol=BF16_RTOL if bf16 else RTOL,
    )
    return actual


# bfloat16 only where every row is a decode: prefill chunks run torch's
# bfloat16 SDPA, not this kernel.
SCENARIO_DTYPES = [(name, torch.float32) for name in SCENARIOS] + [
    ("decodes_ragged", torch.bfloat16)
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("scenario", "dtype"), SCENARIO_DTYPES)
def test_native_backend_matches_reference(
    scenario: str,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> None:
    batch = make_paged_batch(
        SCENARIOS[scenario],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (8, 4), (9, 1)])
def test_native_decode_head_dim_256(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    """Gemma's head_dim 256 takes the run path (groups up to 8, chunked value
    accumulators) or, past 8 heads per KV head, the per-head specialization."""
    lengths = [1, 17, 300, 45]
    batch = make_paged_batch(
        [(length - 1, 1) for length in lengths],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=256,
        block_size=16,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_native_decode_long_ragged_contexts(seed: int, dtype: torch.dtype) -> None:
    """Many GQA decodes through shuffled block tables, contexts of hundreds of
    tokens ending anywhere in a block."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 600, (24,), generator=generator).tolist()
    batch = make_paged_batch(
        [(length - 1, 1) for length in lengths],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        seed=seed,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("lengths", [[2000], [700, 1, 300], [257, 512, 513]])
def test_native_decode_splits_long_contexts_into_runs(
    lengths: list[int], num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    """A batch of few long contexts is cut into runs (split-K) whose partial
    softmaxes are merged (from the avx2 level up; the generic level takes the
    per-head float path over the same batch): run edges inside and at block
    ends, blocks shorter than a 16-token tile, one-token contexts."""
    batch = make_paged_batch(
        [(length - 1, 1) for length in lengths],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_run_in_cpp_not_the_torch_fallback(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    def torch_decode(*args: object) -> None:
        raise AssertionError(f"{dtype} decode fell back to the torch path")

    monkeypatch.setattr(CpuAttentionBackend, "_decode", staticmethod(torch_decode))
    scenario = SCENARIOS["decodes_ragged"]
    batch = make_paged_batch(
        scenario, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scores_do_not_overflow(dtype: torch.dtype) -> None:
    """The max is subtracted before exp: scores of ~1e4 stay finite, also when
    a long context is split into runs whose maxima differ by far more than
    exp's range (the merge rescales them)."""
    batch = make_paged_batch(
        [(1500, 1), (40, 1), (7, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    big = batch.with_query_scaled(1000.0 if dtype == torch.float32 else 64.0)
    expected = run_backend(TorchReferenceBackend(), big.to_float32())
    actual = run_backend(NativeCpuAttentionBackend(), big)
    assert torch.isfinite(actual).all()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(actual.float(), expected, atol=1e-2, rtol=BF16_RTOL)


def _decode_args(num_blocks: int = 4) -> dict[str, torch.Tensor]:
    return {
        "out": torch.zeros(2, 4, 64),
        "query": torch.randn(2, 4, 64),
        "key_cache": torch.randn(num_blocks, 16, 2, 64),
        "value_cache": torch.randn(num_blocks, 16, 2, 64),
        "block_tables": torch.tensor([[0, 1], [2, 3]]),
        "context_lens": torch.tensor([20, 5]),
        "rows": torch.tensor([0, 1]),
    }


def _call(args: dict[str, torch.Tensor]) -> None:
    torch.ops.kvmesh.paged_decode_attention(
        args["out"],
        args["query"],
        args["key_cache"],
        args["value_cache"],
        args["block_tables"],
        args["context_lens"],
        args["rows"],
        0.125,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_tables": torch.tensor([[0, 9], [2, 3]])}, "block id 9 out of range"),
        ({"context_lens": torch.tensor([20, 0])}, "context length 0 out of range"),
        ({"context_lens": torch.tensor([33, 5])}, "context length 33 out of range"),
        ({"rows": torch.tensor([0, 2])}, "row out of range"),
        ({"block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}, "int64"),
        ({"query": torch.randn(2, 4, 64, dtype=torch.float64)}, "float32"),
        ({"key_cache": torch.randn(4, 16, 3, 64)}, "differ in shape"),
        (
            {"key_cache": torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)},
            "key_cache is BFloat16 but query is Float",
        ),
        ({"out": torch.zeros(2, 4, 64, dtype=torch.bfloat16)}, "out is BFloat16 but query"),
    ],
)
def test_bad_inputs_raise_clear_errors(change: dict[str, torch.Tensor], message: str) -> None:
    args = {**_decode_args(), **change}
    with pytest.raises(RuntimeError, match=message):
        _call(args)


@pytest.mark.parametrize("edited", [next(iter(native.SOURCES)), "ggml_blocks.h"])
def test_cache_key_changes_with_any_file_in_csrc(
    monkeypatch: pytest.MonkeyPatch, tmp_path, edited: str
) -> None:
    """A source or a header only sources include (the GGUF block formats): either rebuilds."""
    level = all_levels()[0]
    before = native.build_key(level)
    for path in native.CSRC.iterdir():
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
    monkeypatch.setattr(native, "CSRC", tmp_path)
    assert native.build_key(level) == before
    source = tmp_path / edited
    source.write_text(source.read_text() + "\n// edited\n")
    assert native.build_key(level) != before


def test_each_level_has_its_own_library() -> None:
    """Levels never share a binary, and nothing of the building CPU is in a key:
    a cache or an image built on one CPU serves another."""
    paths = {native.library_path(level) for level in all_levels()}
    assert len(paths) == len(all_levels())
    assert "-march=native" not in native.COMPILE_FLAGS
