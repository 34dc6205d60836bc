"""The oracle itself: properties of attention that hold whatever the implementation."""

from __future__ import annotations

import torch

from kvmesh.kernels import reference
from tests.kernels.paged_batch import make_paged_batch


def test_decode_with_a_single_token_context_returns_its_value() -> None:
    batch = make_paged_batch([(0, 1)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=16)
    reference.write_kv_cache(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    out = reference.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 1.0
    )
    # Softmax over one key is 1: each query head returns its KV head's value.
    expected = batch.value.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected)


def test_chunk_queries_ignore_keys_after_their_position() -> None:
    batch = make_paged_batch([(5, 6)], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    reference.write_kv_cache(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping
    )

    def run() -> torch.Tensor:
        return reference.paged_prefill_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.query_start_loc,
            batch.context_lens,
            batch.scale,
        )

    before = run()
    # Overwrite the chunk's last token: only the last query may change.
    last_slot = batch.slot_mapping[-1:]
    reference.write_kv_cache(
        torch.randn(1, 1, 8), torch.randn(1, 1, 8), batch.k_cache, batch.v_cache, last_slot
    )
    after = run()
    torch.testing.assert_close(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])


def test_decode_equals_prefill_with_one_query_token() -> None:
    batch = make_paged_batch(
        [(7, 1), (20, 1)], num_heads=6, num_kv_heads=3, head_dim=8, block_size=8
    )
    reference.write_kv_cache(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    decode = reference.paged_decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.scale,
    )
    prefill = reference.paged_prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.context_lens,
        batch.scale,
    )
    torch.testing.assert_close(decode, prefill)
