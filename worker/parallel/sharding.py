"""Which slice of each weight, KV head and layer a rank owns (pure arithmetic).

Tensor parallel (TP) splits every layer across ``tp_size`` ranks the Megatron
way: q/k/v and gate/up are column-parallel (each rank computes some output
features: its heads, its slice of the MLP), o_proj and down are row-parallel
(each rank multiplies its input slice; one all-reduce sums the partial
outputs), the embedding and LM head are vocab-parallel. Pipeline parallel (PP)
gives each stage a contiguous range of layers. Which checkpoint tensor is
which kind is the model family's declaration (worker/models/declaration.py).

Heads are split by KV group so that every rank keeps whole groups and the
attention kernels see a uniform ``num_heads / num_kv_heads`` locally. With
fewer KV heads than ranks, each KV head is replicated on ``tp_size /
num_kv_heads`` ranks, each computing a slice of its query heads. Uneven splits
are allowed (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so the default
model runs at TP=2.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.contracts.math_utils import cdiv


def split_range(size: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous near-equal pieces of ``range(size)``."""
    if not 0 <= index < parts:
        raise ValueError(f"index {index} outside {parts} parts")
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class HeadShard:
    """The global query heads and KV heads one TP rank computes."""

    q_heads: range
    kv_heads: range


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = split_range(num_kv_heads, tp_size, tp_rank)
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    # Fewer KV heads than ranks: replicate each KV head over tp_size / num_kv_heads
    # ranks, each holding an equal slice of that head's query group.
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} needs to be a multiple of the {num_kv_heads} KV "
            f"heads and divide the {num_heads} query heads"
        )
    per_rank = num_heads // tp_size
    q = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    kv_head = q.start // group
    return HeadShard(q, range(kv_head, kv_head + 1))


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    """Rows of every rank's vocab shard (the last may hold fewer real rows): equal
    sizes let the logits be all-gathered in one collective."""
    return cdiv(vocab_size, tp_size)


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> range:
    size = vocab_shard_size(vocab_size, tp_size)
    return range(min(tp_rank * size, vocab_size), min((tp_rank + 1) * size, vocab_size))


@dataclass(frozen=True)
class ShardPlan:
    """Everything a rank slices out of the full model; the identity plan is TP=1, PP=1."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    # Mixture-of-experts layers: experts per layer, and each expert's MLP width
    # (split over TP ranks like the dense MLP's; every rank holds every expert).
    num_experts: int = 0
    expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("parallel sizes must be positive")
        if self.pp_size > self.num_layers:
            raise ValueError(f"{self.pp_size} pipeline stages for {self.num_layers} layers")
        partition_heads(self.num_heads, self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def heads(self) -> HeadShard:
        return partition_heads(self.num_heads, self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def intermediate(self) -> range:
        return split_range(self.intermediate_size, self.tp_size, self.tp_rank)

    @property
    def expert_intermediate(self) -> range:
        return split_range(self.expert_intermediate_size, self.tp_size, self.tp_rank)

    @property
    def vocab(self) -> range:
        return vocab_range(self.vocab_size, self.tp_size, self.tp_rank)

    @property
    def layers(self) -> range:
        """This stage's contiguous layers (global indices)."""
        return split_range(self.num_layers, self.pp_size, self.pp_rank)

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding, final norm and LM head: the ring starts and ends here."""
        return self.pp_rank == 0

    def largest_kv_share(self) -> int:
        """KV heads times layers of the rank holding the most (sizes every rank's cache)."""
        return max(
            len(partition_heads(self.num_heads, self.num_kv_heads, self.tp_size, t).kv_heads)
            * len(split_range(self.num_layers, self.pp_size, p))
            for t in range(self.tp_size)
            for p in range(self.pp_size)
        )
