"""One step's adapter layout: requests grouped by slot, tokens in contiguous runs.

The worker orders a step's requests by adapter slot (stably, the base model
first) before flattening their tokens, so each adapter's tokens form one run
and the CPU path is two matmuls per adapter and projection over a row slice.
On a GPU the Triton kernels take the same layout as one slot index per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NO_ADAPTER = -1

# (first token, end token, slot): a run of the step's tokens that share an adapter.
Segment = tuple[int, int, int]


@dataclass(frozen=True)
class LoRABatch:
    """The adapter of every token of a step, as runs and (off CPU) per token."""

    segments: list[Segment]
    # The segments as an int64 [n, 3] tensor, built once per step for the C++
    # kernel's every call (CPU only, else None).
    segment_table: torch.Tensor | None = None
    # [num_tokens] int32 slot per token, -1 for the base model; None on CPU,
    # where the segments are all the CPU path reads.
    token_slots: torch.Tensor | None = None


def order_by_slot(request_slots: np.ndarray) -> np.ndarray:
    """The step order that puts requests of one slot next to each other (stable)."""
    return np.argsort(request_slots, kind="stable")


def plan_lora_batch(
    request_slots: np.ndarray, num_scheduled: np.ndarray, device: torch.device
) -> LoRABatch:
    """Segments of requests already ordered by slot (``order_by_slot``)."""
    ends = np.cumsum(num_scheduled)
    segments: list[Segment] = []
    # Python ints, not numpy scalars: indexing numpy per request took ~75 µs
    # a step of 32 requests on the dev box, about twice this loop's time.
    for slot, end, count in zip(
        request_slots.tolist(), ends.tolist(), num_scheduled.tolist(), strict=True
    ):
        if slot == NO_ADAPTER:
            continue
        start = end - count
        if segments and segments[-1][2] == slot and segments[-1][1] == start:
            segments[-1] = (segments[-1][0], end, slot)
        else:
            segments.append((start, end, slot))
    if device.type == "cpu":
        table = torch.tensor(segments, dtype=torch.int64).reshape(len(segments), 3)
        return LoRABatch(segments, segment_table=table)
    per_token = np.repeat(request_slots.astype(np.int32), num_scheduled)
    return LoRABatch(segments, token_slots=torch.from_numpy(per_token).to(device))
