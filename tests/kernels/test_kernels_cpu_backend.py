"""The fast torch/CPU backend computes exactly what kernels/reference.py defines."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.kernels.backend import AttentionBackend
from kvmesh.kernels.cpu_attention import CpuAttentionBackend
from kvmesh.kernels.torch_reference_backend import TorchReferenceBackend
from tests.kernels.paged_batch import SCENARIOS, make_paged_batch, run_backend

# float32 with a different summation order than the reference (fused SDPA vs
# einsum + softmax): differences are a few ulps of O(1) outputs.
ATOL = 1e-5
RTOL = 1e-5

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GQA_SHAPES = [(9, 3), (4, 4), (8, 1)]  # (num_heads, num_kv_heads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_cpu_backend_matches_reference(
    scenario: str, num_heads: int, num_kv_heads: int, block_size: int, device: str
) -> None:
    batch = make_paged_batch(
        SCENARIOS[scenario],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        device=device,
    )
    expected = run_backend(TorchReferenceBackend(), batch)
    actual = run_backend(CpuAttentionBackend(), batch)
    assert not torch.isnan(actual).any(), "read a never-written (NaN) cache slot"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_cpu_backend_reuses_one_metadata_across_layers() -> None:
    """The worker builds metadata once per step and passes it to every layer."""
    seqs = SCENARIOS["mixed_any_order"]
    backend, reference = CpuAttentionBackend(), TorchReferenceBackend()
    first = make_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=16, block_size=16)
    # Same block layout, different activations per layer (NaN padding stays NaN).
    layers = [
        dataclasses.replace(
            first,
            query=torch.randn_like(first.query),
            key=torch.randn_like(first.key),
            value=torch.randn_like(first.value),
            k_cache=first.k_cache * (layer + 1) - layer,
            v_cache=first.v_cache * (layer + 2),
        )
        for layer in range(3)
    ]
    metadata = layers[0].metadata(backend)
    for batch in layers:
        k_cache, v_cache = batch.fresh_caches()
        backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
        actual = backend.forward(batch.query, k_cache, v_cache, metadata, batch.scale)
        torch.testing.assert_close(actual, run_backend(reference, batch), atol=ATOL, rtol=RTOL)


def test_cpu_backend_accepts_metadata_without_its_plan() -> None:
    """Metadata built by another backend still gives the right answer."""
    batch = make_paged_batch(
        SCENARIOS["mixed_any_order"], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16
    )
    backend = CpuAttentionBackend()
    k_cache, v_cache = batch.fresh_caches()
    backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    foreign = batch.metadata(TorchReferenceBackend)
    actual = backend.forward(batch.query, k_cache, v_cache, foreign, batch.scale)
    torch.testing.assert_close(
        actual, run_backend(TorchReferenceBackend(), batch), atol=ATOL, rtol=RTOL
    )


def test_cpu_backend_rejects_query_that_does_not_match_metadata() -> None:
    batch = make_paged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=16
    )
    backend = CpuAttentionBackend()
    metadata = batch.metadata(backend)
    with pytest.raises(ValueError, match="rows"):
        backend.forward(batch.query[:-1], batch.k_cache, batch.v_cache, metadata, batch.scale)


@pytest.mark.parametrize("backend", [CpuAttentionBackend(), TorchReferenceBackend()])
def test_write_kv_cache_skips_negative_slots(backend: AttentionBackend) -> None:
    k_cache = torch.full((2, 4, 2, 8), float("nan"))
    v_cache = torch.full((2, 4, 2, 8), float("nan"))
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slot_mapping = torch.tensor([5, -1, 2])
    backend.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    flat_k, flat_v = k_cache.view(8, 2, 8), v_cache.view(8, 2, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_v[2], value[2])
    untouched = [s for s in range(8) if s not in (5, 2)]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()
