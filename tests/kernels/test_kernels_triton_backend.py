"""Triton kernels against the reference: on CUDA when present, else in Triton's CPU interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel module is first imported,
so the variable is set here before anything imports ``kernels.triton_*``. On a
CUDA machine it is left alone and the kernels compile for the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from kvmesh.kernels.triton_backend import TritonAttentionBackend
from tests.kernels.paged_batch import SCENARIOS, make_paged_batch, run_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 throughout (ieee dot products, float32 online softmax); the online
# softmax rescales partial sums block by block, so allow a few more ulps than
# the single-pass CPU path.
ATOL = 2e-5
RTOL = 2e-5

if DEVICE == "cpu" and not TritonAttentionBackend.supports_device(torch.device("cpu")):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_backend_matches_reference(
    scenario: str, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    batch = make_paged_batch(
        SCENARIOS[scenario],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,  # tiny: the interpreter runs every program in numpy
        block_size=block_size,
        device=DEVICE,
    )
    expected = run_backend(TorchReferenceBackend(), batch)
    actual = run_backend(TritonAttentionBackend(), batch)
    assert not torch.isnan(actual).any(), "read a never-written (NaN) cache slot"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_triton_prefill_longer_than_one_query_tile() -> None:
    """A chunk spanning several query tiles, on a prefix ending mid-block, head_dim not 2^k."""
    batch = make_paged_batch(
        [(3, 1), (21, 70), (0, 1)],
        num_heads=6,
        num_kv_heads=2,
        head_dim=24,
        block_size=16,
        device=DEVICE,
    )
    torch.testing.assert_close(
        run_backend(TritonAttentionBackend(), batch),
        run_backend(TorchReferenceBackend(), batch),
        atol=ATOL,
        rtol=RTOL,
    )


def test_triton_reads_strided_query_views() -> None:
    """The worker may pass q as a view of a fused QKV projection."""
    batch = make_paged_batch(
        SCENARIOS["mixed_any_order"], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
        device=DEVICE,
    )  # fmt: skip
    fused = torch.randn(batch.query.shape[0], 8, 16, device=DEVICE)
    fused[:, 2:6] = batch.query
    strided = fused[:, 2:6]
    backend = TritonAttentionBackend()
    k_cache, v_cache = batch.fresh_caches()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    actual = backend.forward(strided, k_cache, v_cache, batch.metadata(backend), batch.scale)
    expected = run_backend(TorchReferenceBackend(), batch)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_triton_write_kv_cache_skips_negative_slots() -> None:
    k_cache = torch.full((2, 16, 2, 8), float("nan"), device=DEVICE)
    v_cache = torch.full((2, 16, 2, 8), float("nan"), device=DEVICE)
    key = torch.randn(3, 2, 8, device=DEVICE)
    value = torch.randn(3, 2, 8, device=DEVICE)
    slot_mapping = torch.tensor([17, -1, 2], device=DEVICE)
    TritonAttentionBackend().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    flat_k, flat_v = k_cache.view(32, 2, 8), v_cache.view(32, 2, 8)
    assert torch.equal(flat_k[17], key[0]) and torch.equal(flat_v[2], value[2])
    untouched = [s for s in range(32) if s not in (17, 2)]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_triton_refuses_blocks_smaller_than_its_tiles() -> None:
    batch = make_paged_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8,
                             device=DEVICE)  # fmt: skip
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="block_size"):
        backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.metadata(backend), 1.0)
