"""The worker's segmented LoRA path equals the grouped per-token reference
(kernels/lora_reference.py) on a step that mixes slots, ranks and the base model."""

from __future__ import annotations

import numpy as np
import torch

from kernels.lora_reference import add_lora_reference
from services.lora_files import AdapterConfig
from worker.lora.adapter import LoRAAdapter
from worker.lora.slots import ProjectionShape, ProjectionSlots
from worker.lora.step_batch import NO_ADAPTER, order_by_slot, plan_lora_batch

# A fused projection of three slices, as the model's q/k/v.
SHAPE = ProjectionShape(12, (("q_proj", 0, 8), ("k_proj", 8, 4), ("v_proj", 12, 4)))
MAX_RANK = 6


def _adapter(rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    sizes = {name: size for name, _, size in SHAPE.slices}
    tensors = {
        (0, name): (
            torch.randn(rank, SHAPE.in_features, generator=generator),
            torch.randn(sizes[name], rank, generator=generator),
        )
        for name in modules
    }
    return LoRAAdapter(AdapterConfig(rank, 2.0 * rank, modules), tensors)


def test_segments_equal_the_per_token_reference() -> None:
    slots = ProjectionSlots(SHAPE, 3, MAX_RANK, torch.float32, torch.device("cpu"))
    slots.fill(0, _adapter(6, ("q_proj", "k_proj", "v_proj"), 0), 0)
    slots.fill(1, _adapter(2, ("k_proj",), 1), 0)  # one slice, rank below the max
    slots.fill(2, _adapter(4, ("q_proj", "v_proj"), 2), 0)
    # Requests in scheduler order: slot per request (-1: base) and tokens scheduled.
    request_slots = np.array([2, NO_ADAPTER, 0, 2, 1, NO_ADAPTER, 0])
    num_scheduled = np.array([3, 2, 1, 1, 4, 1, 2])
    order = order_by_slot(request_slots)
    request_slots, num_scheduled = request_slots[order], num_scheduled[order]
    assert list(request_slots) == [NO_ADAPTER, NO_ADAPTER, 0, 0, 1, 2, 2]
    batch = plan_lora_batch(request_slots, num_scheduled, torch.device("cpu"))
    # Requests of one slot merge into one segment; base tokens are in none.
    assert batch.segments == [(3, 6, 0), (6, 10, 1), (10, 14, 2)]
    num_tokens = int(num_scheduled.sum())
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(num_tokens, SHAPE.in_features, generator=generator)
    y = torch.randn(num_tokens, SHAPE.out_features, generator=generator)
    got = y.clone()
    slots.add_delta(got, x, batch.segments)
    token_slots = torch.from_numpy(np.repeat(request_slots, num_scheduled))
    expected = add_lora_reference(y.clone(), x, slots.lora_a, slots.lora_b, token_slots)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[:3], y[:3])  # base tokens untouched


def test_a_slice_the_adapter_does_not_target_gets_no_delta() -> None:
    slots = ProjectionSlots(SHAPE, 1, MAX_RANK, torch.float32, torch.device("cpu"))
    slots.fill(0, _adapter(3, ("k_proj",), 5), 0)
    x = torch.randn(2, SHAPE.in_features)
    y = torch.zeros(2, SHAPE.out_features)
    slots.add_delta(y, x, [(0, 2, 0)])
    assert torch.count_nonzero(y[:, :8]) == 0 and torch.count_nonzero(y[:, 12:]) == 0
    assert torch.count_nonzero(y[:, 8:12]) == 8
