"""Each linear's TP shards reassemble to the full weight; heads, layers, vocab split as said."""

from __future__ import annotations

import pytest
import torch

from kvmesh.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from kvmesh.worker.models.phi3 import Phi3ForCausalLM
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.sharding import ShardPlan, partition_heads, split_range

HEAD_DIM = 4
HIDDEN = 12
INTERMEDIATE = 10
VOCAB = 11


def shard(plan: ShardPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a checkpoint tensor, as the Llama/Qwen2 declaration cuts it."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return tensor[plan.vocab.start : plan.vocab.stop]
    declaration = Qwen2ForCausalLM.declaration  # Llama's plus q/k/v biases
    return declaration.shard_layer_tensor(name, tensor, plan, HIDDEN)


def plans(num_heads: int, num_kv_heads: int, tp_size: int) -> list[ShardPlan]:
    return [
        ShardPlan(num_heads, num_kv_heads, HEAD_DIM, INTERMEDIATE, VOCAB, 4, tp_size, rank)
        for rank in range(tp_size)
    ]


def test_split_range_covers_everything_once_in_near_equal_pieces() -> None:
    pieces = [split_range(10, 4, i) for i in range(4)]
    assert [len(p) for p in pieces] == [3, 3, 2, 2]
    assert [i for p in pieces for i in p] == list(range(10))


def test_heads_split_by_whole_kv_groups_unevenly() -> None:
    # SmolLM2's shape: 9 query heads in 3 KV groups over 2 ranks.
    shards = [partition_heads(9, 3, 2, rank) for rank in range(2)]
    assert [s.kv_heads for s in shards] == [range(0, 2), range(2, 3)]
    assert [s.q_heads for s in shards] == [range(0, 6), range(6, 9)]


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head() -> None:
    shards = [partition_heads(8, 2, 4, rank) for rank in range(4)]
    assert [s.kv_heads for s in shards] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [s.q_heads for s in shards] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="multiple"):
        partition_heads(8, 3, 4, 0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp_size"), [(6, 3, 2), (4, 4, 4), (6, 3, 3)]
)
def test_column_parallel_shards_reassemble_along_rows(
    num_heads: int, num_kv_heads: int, tp_size: int
) -> None:
    weights = {
        "self_attn.q_proj.weight": torch.randn(num_heads * HEAD_DIM, HIDDEN),
        "self_attn.q_proj.bias": torch.randn(num_heads * HEAD_DIM),
        "self_attn.k_proj.weight": torch.randn(num_kv_heads * HEAD_DIM, HIDDEN),
        "self_attn.v_proj.weight": torch.randn(num_kv_heads * HEAD_DIM, HIDDEN),
        "mlp.gate_proj.weight": torch.randn(INTERMEDIATE, HIDDEN),
        "mlp.up_proj.weight": torch.randn(INTERMEDIATE, HIDDEN),
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN),
    }
    for name, full in weights.items():
        shards = [shard(plan, name, full) for plan in plans(num_heads, num_kv_heads, tp_size)]
        assert torch.equal(torch.cat(shards, dim=0), full), name


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp_size"), [(6, 3, 2), (4, 4, 4)])
def test_row_parallel_shards_reassemble_along_columns_and_sum_to_the_product(
    num_heads: int, num_kv_heads: int, tp_size: int
) -> None:
    torch.manual_seed(0)
    for name, in_features in (
        ("self_attn.o_proj.weight", num_heads * HEAD_DIM),
        ("mlp.down_proj.weight", INTERMEDIATE),
    ):
        full = torch.randn(HIDDEN, in_features, dtype=torch.float64)
        x = torch.randn(3, in_features, dtype=torch.float64)
        rank_plans = plans(num_heads, num_kv_heads, tp_size)
        shards = [shard(plan, name, full) for plan in rank_plans]
        assert torch.equal(torch.cat(shards, dim=1), full), name
        # What the all-reduce computes: each rank's input slice times its shard.
        pieces = torch.split(x, [s.shape[1] for s in shards], dim=1)
        partial_sum = sum(p @ s.T for p, s in zip(pieces, shards, strict=True))
        torch.testing.assert_close(partial_sum, x @ full.T)


def test_replicated_kv_head_shards_are_copies_of_one_head() -> None:
    full = torch.randn(2 * HEAD_DIM, HIDDEN)
    shards = [shard(plan, "self_attn.k_proj.weight", full) for plan in plans(8, 2, 4)]
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[0], full[:HEAD_DIM])
    assert torch.equal(shards[2], shards[3]) and torch.equal(shards[2], full[HEAD_DIM:])


def test_norms_are_not_sharded() -> None:
    norm = torch.randn(HIDDEN)
    for plan in plans(6, 3, 2):
        assert shard(plan, "input_layernorm.weight", norm) is norm


@pytest.mark.parametrize("tp_size", [2, 3])
def test_a_fused_checkpoint_tensor_shards_like_its_split_tensors(tp_size: int) -> None:
    """Phi-3's qkv_proj/gate_up_proj hold q|k|v and gate|up: each run is cut
    like Llama's separate tensor, so both layouts load the same rank weights."""
    q = torch.randn(6 * HEAD_DIM, HIDDEN)
    k, v = torch.randn(3 * HEAD_DIM, HIDDEN), torch.randn(3 * HEAD_DIM, HIDDEN)
    gate, up = torch.randn(INTERMEDIATE, HIDDEN), torch.randn(INTERMEDIATE, HIDDEN)
    fused, split = Phi3ForCausalLM.declaration, LlamaForCausalLM.declaration
    for plan in plans(6, 3, tp_size):
        qkv = fused.shard_layer_tensor(
            "self_attn.qkv_proj.weight", torch.cat([q, k, v]), plan, HIDDEN
        )
        expected = [
            split.shard_layer_tensor(f"self_attn.{n}_proj.weight", t, plan, HIDDEN)
            for n, t in (("q", q), ("k", k), ("v", v))
        ]
        assert torch.equal(qkv, torch.cat(expected))
        gate_up = fused.shard_layer_tensor(
            "mlp.gate_up_proj.weight", torch.cat([gate, up]), plan, HIDDEN
        )
        expected = [
            split.shard_layer_tensor(f"mlp.{n}_proj.weight", t, plan, HIDDEN)
            for n, t in (("gate", gate), ("up", up))
        ]
        assert torch.equal(gate_up, torch.cat(expected))


def test_vocab_shards_are_equal_width_but_the_last() -> None:
    assert [p.vocab for p in plans(4, 2, 2)] == [range(0, 6), range(6, 11)]


def test_pipeline_stages_get_contiguous_layers_and_the_first_holds_the_head() -> None:
    stages = [ShardPlan(4, 2, HEAD_DIM, 8, VOCAB, 30, pp_size=4, pp_rank=p) for p in range(4)]
    assert [s.layers for s in stages] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [s.is_first_stage for s in stages] == [True, False, False, False]
    with pytest.raises(ValueError, match="stages"):
        ShardPlan(4, 2, HEAD_DIM, 8, VOCAB, 2, pp_size=3)


def test_largest_kv_share_sizes_every_rank_alike() -> None:
    # 3 KV heads over 2 ranks (2 and 1) and 30 layers over 4 stages (8 most).
    plan = ShardPlan(9, 3, 64, 1536, 49152, 30, tp_size=2, pp_size=4)
    assert plan.largest_kv_share() == 2 * 8


def test_rank_layout_places_tp_ranks_inside_each_stage() -> None:
    layouts = [RankLayout(2, 2, rank) for rank in range(4)]
    assert [(lay.tp_rank, lay.pp_rank) for lay in layouts] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [lay.next_stage_rank for lay in layouts] == [2, 3, 0, 1]
    assert [lay.previous_stage_rank for lay in layouts] == [2, 3, 0, 1]
    assert layouts[0].is_driver and not layouts[1].is_driver
    assert layouts[0].tp_group_ranks(1) == [2, 3]
