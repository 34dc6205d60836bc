"""Sliding-window attention and attention-score soft-capping in every backend.

The reference (kernels/reference.py) is checked once against a dense
computation with transformers' own sliding-window mask and Gemma 2's soft-cap
formula; then every backend (the torch CPU path, the C++ kernels, batch-invariant
mode, Triton in its interpreter) against the reference, over contexts longer
than the window, windows that are not a multiple of the block size, and block
tables whose blocks before each window are freed (a never-written NaN block,
or an out-of-range id, in their place): a kernel that reads one fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvmesh.kernels import batch_invariant, native, reference
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from tests.kernels.paged_batch import (
    WINDOW_SCENARIOS,
    PagedBatch,
    free_out_of_window,
    make_paged_batch,
    run_backend,
)

# float32, another order of sums (and a vectorized exp/tanh) than the reference.
ATOL = 2e-5
RTOL = 2e-5
WINDOWS = [5, 16, 37]  # 16 a block size; 5 and 37 cut blocks
SOFTCAP = 2.0  # small enough that it changes scores of O(1..5)


def _batch(scenario: str, block_size: int, head_dim: int = 64, **kw: object) -> PagedBatch:
    batch = make_paged_batch(
        WINDOW_SCENARIOS[scenario],
        num_heads=kw.pop("num_heads", 6),  # type: ignore[arg-type]
        num_kv_heads=kw.pop("num_kv_heads", 2),  # type: ignore[arg-type]
        head_dim=head_dim,
        block_size=block_size,
        **kw,  # type: ignore[arg-type]
    )
    # Scores of a few units, so that a soft-cap of 2 is far from the identity.
    return batch.with_query_scaled(3.0)


def _dense_hf(batch: PagedBatch, window: int | None, softcap: float | None) -> torch.Tensor:
    """Each sequence's attention from its whole K/V with transformers' mask
    function and Gemma 2's eager soft-cap (scores / cap, tanh, * cap)."""
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    mask_fn = (
        causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    )
    k_cache, v_cache = batch.fresh_caches()
    reference.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    block_size = k_cache.shape[1]
    out = torch.empty_like(batch.query)
    starts = batch.query_start_loc.tolist()
    for seq, context in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(context)
        slots = batch.block_tables[seq].long()[positions // block_size] * block_size
        slots = slots + positions % block_size
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [ctx, H_kv, D]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        q = batch.query[starts[seq] : starts[seq + 1]]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_idx = torch.arange(context - q.shape[0], context)[:, None]
        allowed = mask_fn(0, 0, q_idx, positions[None, :])
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[starts[seq] : starts[seq + 1]] = torch.einsum(
            "hqk,khd->qhd", torch.softmax(scores, -1), v
        )
    return out


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("scenario", list(WINDOW_SCENARIOS))
def test_reference_is_transformers_mask_and_softcap(
    scenario: str, window: int | None, softcap: float | None
) -> None:
    batch = _batch(scenario, block_size=4)
    expected = _dense_hf(batch, window, softcap)
    freed = batch if window is None else free_out_of_window(batch, window, null_block=10**6)
    actual = run_backend(TorchReferenceBackend(), freed, window, softcap)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_window_and_softcap_change_the_output() -> None:
    """The options are not no-ops on these batches (else the tests below prove nothing)."""
    batch = _batch("window_mixed", block_size=16)
    full = run_backend(TorchReferenceBackend(), batch)
    windowed = run_backend(TorchReferenceBackend(), batch, sliding_window=16)
    capped = run_backend(TorchReferenceBackend(), batch, softcap=SOFTCAP)
    assert (full - windowed).abs().max() > 0.1
    assert (full - capped).abs().max() > 0.1


def _check_backend(
    backend: object, batch: PagedBatch, window: int | None, softcap: float | None
) -> None:
    expected = run_backend(TorchReferenceBackend(), batch, window, softcap)
    freed = batch if window is None else free_out_of_window(batch, window)
    actual = run_backend(backend, freed, window, softcap)  # type: ignore[arg-type]
    assert not torch.isnan(actual).any(), "read a freed (NaN) block before the window"
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("scenario", list(WINDOW_SCENARIOS))
def test_cpu_backend_window_and_softcap(
    scenario: str, block_size: int, window: int, softcap: float | None
) -> None:
    _check_backend(CpuAttentionBackend(), _batch(scenario, block_size), window, softcap)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_cpu_backend_softcap_without_window(softcap: float | None) -> None:
    _check_backend(CpuAttentionBackend(), _batch("window_mixed", 16), None, softcap)


needs_native = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=f"C++ kernels: {native.unavailable_reason()}"
)


@needs_native
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", [64, 256, 32])  # the run path (and prefill kernel); generic
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("scenario", list(WINDOW_SCENARIOS))
def test_native_backend_window_and_softcap(
    scenario: str, block_size: int, head_dim: int, window: int, softcap: float | None
) -> None:
    """Decodes in paged_decode_attention, chunks in paged_prefill_attention
    (head_dim 64 from the avx2 level up; 32 takes the torch path for chunks)."""
    batch = _batch(scenario, block_size, head_dim)
    _check_backend(NativeCpuAttentionBackend(), batch, window, softcap)


@needs_native
def test_native_kernels_never_validate_blocks_before_the_window() -> None:
    """Out-of-range ids before each window (a freed block's entry) are not
    read, nor refused; within the window they still are."""
    batch = _batch("window_mixed", 4)
    expected = run_backend(TorchReferenceBackend(), batch, 16, None)
    freed = free_out_of_window(batch, 16, null_block=10**6)
    actual = run_backend(NativeCpuAttentionBackend(), freed, 16, None)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    with pytest.raises(RuntimeError, match="block id"):
        run_backend(NativeCpuAttentionBackend(), freed, 64, None)


@needs_native
def test_native_decode_bfloat16_window_and_softcap() -> None:
    batch = _batch("window_decodes", 16, dtype=torch.bfloat16)
    expected = run_backend(TorchReferenceBackend(), batch.to_float32(), 16, SOFTCAP)
    actual = run_backend(NativeCpuAttentionBackend(), free_out_of_window(batch, 16), 16, SOFTCAP)
    torch.testing.assert_close(actual.float(), expected, atol=2**-6, rtol=2**-6)


@needs_native
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window", WINDOWS)
def test_batch_invariant_mode_window_and_softcap(window: int, softcap: float | None) -> None:
    """Every row as a decode of its own context, over its own window; long
    contexts split into fixed runs cut at the window start."""
    batch = _batch("window_mixed", 16)
    with batch_invariant.forced(True):
        _check_backend(NativeCpuAttentionBackend(), batch, window, softcap)
    # Past RUN_TOKENS, with a window spanning a run boundary.
    long = make_paged_batch(
        [(600, 1), (0, 300)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16
    )
    with batch_invariant.forced(True):
        _check_backend(NativeCpuAttentionBackend(), long, 300, softcap)


@pytest.fixture(scope="module")
def triton_backend() -> object:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from kvmesh.kernels.triton_backend import TritonAttentionBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not TritonAttentionBackend.supports_device(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 at import")
    return TritonAttentionBackend()


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window", [5, 37])
@pytest.mark.parametrize("scenario", ["window_decodes", "window_mixed"])
def test_triton_window_and_softcap(
    triton_backend: object, scenario: str, window: int, softcap: float | None
) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Tiny heads: the interpreter runs every program in numpy.
    batch = _batch(scenario, 16, head_dim=16, num_heads=4, num_kv_heads=2, device=device)
    _check_backend(triton_backend, batch, window, softcap)
