"""Per-request pooling parameters (vLLM's PoolingParams), shared by every service.

A request whose SamplingParams carry these is a pooling request: the
scheduler computes its whole prompt in one step without KV blocks and the
worker's pooling runner answers its pooled vector instead of a token. They
travel inside ``kvmesh.internal.v1.SamplingParams.pooling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request wants from the pooled hidden states."""

    # "embed": the sentence embedding; "classify": the head's raw logits.
    task: PoolingTask = "embed"
    # Matryoshka cut (first ``dimensions`` values, before normalization); None: all.
    dimensions: int | None = None
    # None: as the model's pipeline does.
    normalize: bool | None = None
    # Tokens of a pair's first text; the rest get token type 1 (None: one text).
    first_segment_len: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; expected one of {POOLING_TASKS}")
        if self.dimensions is not None and self.dimensions <= 0:
            raise ValueError(f"dimensions must be positive, got {self.dimensions}")
