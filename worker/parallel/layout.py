"""Where a rank sits in a replica: ``rank = pp_rank * tp_size + tp_rank``.

Rank 0 (stage 0, TP rank 0) is the driver: it holds the scheduler's Execute
stream, broadcasts each step to the other ranks and samples.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor and pipeline parallel sizes must be positive")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        return [pp_rank * self.tp_size + t for t in range(self.tp_size)]

    @property
    def next_stage_rank(self) -> int:
        """Where this rank's activations go: the same TP rank of the next stage; the
        last stage hands the final hidden states back to stage 0, which holds the LM head."""
        return ((self.pp_rank + 1) % self.pp_size) * self.tp_size + self.tp_rank

    @property
    def previous_stage_rank(self) -> int:
        return ((self.pp_rank - 1) % self.pp_size) * self.tp_size + self.tp_rank
