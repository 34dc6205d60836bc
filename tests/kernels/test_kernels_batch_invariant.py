"""Batch-invariant mode's kernels: a row's result does not depend on the rows around it."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import batch_invariant, native
from kvmesh.kernels.registry import select_attention_backend
from kvmesh.services.runtime.config import WorkerConfig
from kvmesh.services.runtime.config.process import BATCH_INVARIANT
from kvmesh.worker.models.linear import MAX_BLOCK_CODE_ROWS, PackedLinear

from .paged_batch import PagedBatch, make_paged_batch
from .test_kernels_block_codes import q4_1_weight

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"C++ kernels unavailable: {native.unavailable_reason()}",
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# A batch of decodes and the caches holding their K/V.
Decodes = tuple[PagedBatch, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def long_decodes() -> Decodes:
    """16 decodes of 700-token contexts, their K/V in the cache."""
    batch = make_paged_batch(
        [(699, 1)] * 16,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        seed=3,
    )
    k_cache, v_cache = batch.fresh_caches()
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)
    flat_k[batch.slot_mapping] = batch.key
    flat_v[batch.slot_mapping] = batch.value
    return batch, k_cache, v_cache


def _first_decode(long_decodes: Decodes, count: int, run_tokens: int) -> torch.Tensor:
    """The first decode's output when the op runs the first ``count`` decodes."""
    batch, k_cache, v_cache = long_decodes
    out = torch.zeros_like(batch.query)
    torch.ops.kvmesh.paged_decode_attention(
        out,
        batch.query,
        k_cache,
        v_cache,
        batch.block_tables[:count].long(),
        batch.context_lens[:count].long(),
        batch.query_start_loc[:count].long(),
        batch.scale,
        run_tokens,
    )
    return out[0]


def test_fixed_runs_give_a_decode_the_same_bits_in_any_batch(long_decodes: Decodes) -> None:
    alone = _first_decode(long_decodes, 1, batch_invariant.RUN_TOKENS)
    for count in (4, 16):
        got = _first_decode(long_decodes, count, batch_invariant.RUN_TOKENS)
        assert torch.equal(got, alone), count


def test_runs_sized_from_the_batch_change_a_decode(long_decodes: Decodes) -> None:
    """Without fixed runs a big batch splits the context differently: the check can fail."""
    assert not torch.equal(_first_decode(long_decodes, 16, 0), _first_decode(long_decodes, 1, 0))


def test_prompt_rows_attend_as_their_decodes() -> None:
    """In the mode, a prompt chunk's rows over a cached prefix equal the same
    positions computed one decode at a time (chunk of 1)."""
    prefix, chunk = 300, 40
    batch = make_paged_batch(
        [(prefix, chunk)],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
    )
    with batch_invariant.forced(True):
        backend = select_attention_backend("cpu")
        k_cache, v_cache = batch.fresh_caches()
        backend.write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
        whole = backend.forward(batch.query, k_cache, v_cache, batch.metadata(backend), batch.scale)
        for i in (0, 17, chunk - 1):
            one = backend.build_metadata(
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                context_lens=torch.tensor([prefix + i + 1], dtype=torch.int32),
                block_tables=batch.block_tables,
                slot_mapping=batch.slot_mapping[i : i + 1],
            )
            row = backend.forward(batch.query[i : i + 1], k_cache, v_cache, one, batch.scale)
            assert torch.equal(row[0], whole[i]), i


def test_the_mode_takes_the_native_backend_and_refuses_others() -> None:
    with batch_invariant.forced(True):
        assert select_attention_backend("cpu").name == "cpu_native"
        with pytest.raises(ValueError, match="not batch-invariant"):
            select_attention_backend("cpu", "cpu")


@pytest.mark.parametrize("codes", [True, False], ids=["block codes", "dense oneDNN"])
def test_a_projection_row_is_the_same_in_any_batch(codes: bool) -> None:
    weight = q4_1_weight(96, 1536)
    linear = PackedLinear(weight, torch.randn(96), use_block_codes=codes)
    assert linear.uses_block_codes == codes
    x = torch.randn(100, 1536)
    with batch_invariant.forced(True):
        alone = linear(x[:3])
        for rows in (MAX_BLOCK_CODE_ROWS + 1, 17, 100):
            assert torch.equal(linear(x[:rows])[:3], alone), rows


def test_without_the_mode_small_and_large_batches_take_different_kernels() -> None:
    """Small batches run the codes, large ones oneDNN: a row's bits change. Where
    float32 weights are kept as panels (the avx2 level) the large batches run the
    panels' blocked GEMM, whose sums are the codes kernel's chains: bits kept."""
    linear = PackedLinear(q4_1_weight(96, 1536), None)  # oneDNN splits K this long
    x = torch.randn(100, 1536)
    with batch_invariant.forced(False):
        same = torch.equal(linear(x)[:3], linear(x[:3]))
    assert same == native.blocked_gemm_loaded()


def test_tiled_rows_pads_the_last_tile_and_keeps_every_row() -> None:
    seen: list[int] = []

    def kernel(tile: torch.Tensor) -> torch.Tensor:
        seen.append(tile.shape[0])
        return tile * 2

    x = torch.randn(37, 8)
    assert torch.equal(batch_invariant.tiled_rows(x, kernel), x * 2)
    assert seen == [batch_invariant.ROW_TILE] * 3
    assert batch_invariant.tiled_rows(x[:0], kernel).shape == (0, 8)


def test_the_mode_runs_on_cpu_only_and_is_read_from_vllm_batch_invariant() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        batch_invariant.enable(True, "cuda")
    assert not batch_invariant.enabled()
    assert BATCH_INVARIANT.get({"VLLM_BATCH_INVARIANT": "1"}) is True
    assert BATCH_INVARIANT.get({}) is False
    assert WorkerConfig(batch_invariant=True).batch_invariant
