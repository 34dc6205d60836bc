"""The per-step C++ ops against the torch ops they replace: greedy_argmax
(torch.argmax over rows, to the index) and write_kv_cache
(reference.write_kv_cache, to the bit), with the edge cases torch defines."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import reference
from kvmesh.kernels.cpu_native_backend import NativeCpuAttentionBackend, _native_write_fits
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.sampler import Sampler, row_argmax
from tests.worker.sampling_lists import sampling_metadata_from_lists


@pytest.fixture(scope="module")
def backend() -> NativeCpuAttentionBackend:
    return NativeCpuAttentionBackend()  # builds/loads the ops or fails with the reason


@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("vocab", [1, 255, 256, 257, 49152])
def test_greedy_argmax_is_torch_argmax(backend, rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(rows * 100_003 + vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    expected = logits.argmax(dim=-1)
    actual = torch.ops.kvmesh.greedy_argmax(logits)
    assert actual.dtype == torch.int64
    assert torch.equal(actual, expected)


def test_greedy_argmax_takes_the_first_of_equal_maxima(backend) -> None:
    logits = torch.zeros(4, 1000)
    logits[0, [7, 300, 999]] = 5.0  # ties in different search chunks
    logits[1, [600, 601]] = 2.0  # ties in one chunk
    logits[2] = float("-inf")  # nothing but -inf: index 0, as torch
    logits[3, 999] = float("inf")
    assert torch.ops.kvmesh.greedy_argmax(logits).tolist() == [7, 600, 0, 999]
    assert torch.equal(torch.ops.kvmesh.greedy_argmax(logits), logits.argmax(dim=-1))


def test_greedy_argmax_lets_the_first_nan_win_as_torch_does(backend) -> None:
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(1))
    logits[0, 1500] = float("nan")
    logits[0, 1800] = float("nan")
    logits[1, 0] = float("nan")
    logits[2, 10] = float("inf")
    logits[2, 1999] = float("nan")
    assert torch.ops.kvmesh.greedy_argmax(logits).tolist() == [1500, 0, 1999]
    assert torch.equal(torch.ops.kvmesh.greedy_argmax(logits), logits.argmax(dim=-1))


def test_greedy_argmax_reads_rows_with_a_wider_stride(backend) -> None:
    wide = torch.randn(8, 3000, generator=torch.Generator().manual_seed(2))
    logits = wide[:, :2500]  # unit vocab stride, rows 3000 apart
    assert torch.equal(torch.ops.kvmesh.greedy_argmax(logits), logits.argmax(dim=-1))


def test_row_argmax_falls_back_where_the_op_does_not_apply(backend) -> None:
    generator = torch.Generator().manual_seed(3)
    for tensor in (
        torch.randn(4, 100, generator=generator).bfloat16(),  # not float32
        torch.randn(100, 4, generator=generator).t(),  # vocab not unit-stride
        torch.randn(100, generator=generator),  # one dimension
    ):
        assert torch.equal(row_argmax(tensor, native=True), tensor.argmax(dim=-1))


def _kv_case(dtype: torch.dtype, num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size, heads, head_dim = 12, 16, 3, 64
    shape = (num_blocks, block_size, heads, head_dim)
    k_cache = torch.randn(*shape, generator=generator).to(dtype)
    v_cache = torch.randn(*shape, generator=generator).to(dtype)
    # Key and value as views into a fused QKV output: rows wider than K alone.
    qkv = torch.randn(num_tokens, (3 + 2 * heads) * head_dim, generator=generator).to(dtype)
    key = qkv[:, 3 * head_dim : (3 + heads) * head_dim].view(num_tokens, heads, head_dim)
    value = qkv[:, (3 + heads) * head_dim :].view(num_tokens, heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 16, 150])  # 150: split over threads
def test_write_kv_cache_matches_the_reference(backend, dtype: torch.dtype, num_tokens: int) -> None:
    key, value, k_cache, v_cache, slots = _kv_case(dtype, num_tokens, seed=num_tokens)
    slots[::5] = -1  # skipped tokens
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    assert _native_write_fits(key, value, k_cache, v_cache, slots)
    backend.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_kv_cache_refuses_a_slot_past_the_cache(backend) -> None:
    key, value, k_cache, v_cache, slots = _kv_case(torch.float32, 4, seed=9)
    slots[2] = k_cache.shape[0] * k_cache.shape[1]
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.kvmesh.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)  # checked before any row is written


def test_write_kv_cache_falls_back_for_another_cache_dtype(backend) -> None:
    key, value, k_cache, v_cache, slots = _kv_case(torch.float32, 8, seed=4)
    k_half, v_half = k_cache.bfloat16(), v_cache.bfloat16()
    assert not _native_write_fits(key, value, k_half, v_half, slots)
    # The torch path then refuses the mix as it always did (no silent conversion).
    with pytest.raises(RuntimeError, match="dtype"):
        backend.write_kv_cache(key, value, k_half, v_half, slots)


def test_the_sampler_draws_the_same_tokens_with_the_native_ops(backend) -> None:
    """Greedy rows and seeded random rows (one key each, the same inverse transform) alike."""
    vocab = 5000
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_k=50, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    ]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5)) * 3

    def draw(native: bool) -> list[int]:
        generators = {
            row: torch.Generator().manual_seed(100 + row)
            for row, p in enumerate(params)
            if p.temperature > 0
        }
        metadata = sampling_metadata_from_lists(
            params, [[1, 2]] * len(params), [[]] * len(params), generators, [0], vocab
        )
        return Sampler(native=native)(logits.clone(), metadata).token_ids.tolist()

    assert draw(native=True) == draw(native=False)
