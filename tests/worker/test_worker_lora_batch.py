"""The worker's segmented LoRA paths (torch matmuls and the C++ kernel) equal the
grouped per-token reference (kernels/lora_reference.py) on steps that mix slots,
ranks and the base model, in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.lora_reference import add_lora_reference
from kvmesh.services.contracts.lora_files import AdapterConfig
from kvmesh.worker.lora.adapter import LoRAAdapter
from kvmesh.worker.lora.setup import native_lora_unavailable_reason
from kvmesh.worker.lora.slots import ProjectionShape, ProjectionSlots
from kvmesh.worker.lora.step_batch import NO_ADAPTER, LoRABatch, order_by_slot, plan_lora_batch
from tests.kernels.ulp import assert_bf16_close

# A fused projection of three slices, as the model's q/k/v.
SHAPE = ProjectionShape(12, (("q_proj", 0, 8), ("k_proj", 8, 4), ("v_proj", 12, 4)))
# Sizes off the kernel's vector widths, slices of different heights (gate/up-like).
WIDE = ProjectionShape(100, (("gate_proj", 0, 72), ("up_proj", 72, 37)))
# Tall enough (>= 256 outputs) that with 2+ threads and one tile of tokens the
# kernel splits the output rows between items, mid-slice.
TALL = ProjectionShape(40, (("gate_proj", 0, 200), ("up_proj", 200, 100)))
SHAPES = {"qkv": SHAPE, "wide": WIDE, "tall": TALL}
MAX_RANK = 6
CPU = torch.device("cpu")
KERNELS = ["torch", "native"]


def _adapter(shape: ProjectionShape, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    sizes = {name: size for name, _, size in shape.slices}
    tensors = {
        (0, name): (
            torch.randn(rank, shape.in_features, generator=generator),
            torch.randn(sizes[name], rank, generator=generator),
        )
        for name in modules
    }
    return LoRAAdapter(AdapterConfig(rank, 2.0 * rank, modules), tensors)


def _slots(shape: ProjectionShape, kernel: str, dtype: torch.dtype) -> ProjectionSlots:
    """Three slots: every slice at the max rank, one slice at rank 2, two slices at 4."""
    names = [name for name, _, _ in shape.slices]
    slots = ProjectionSlots(shape, 3, MAX_RANK, dtype, CPU)
    slots.fill(0, _adapter(shape, 6, tuple(names), 0), 0)
    slots.fill(1, _adapter(shape, 2, (names[1],), 1), 0)  # one slice, rank below the max
    slots.fill(2, _adapter(shape, 4, (names[0], names[-1]), 2), 0)
    if kernel == "native":
        if native.unavailable_reason() is not None:
            pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
        slots.native = True
        slots.min_parallel_macs = 0  # these small cases too use every thread
    return slots


def _run(slots: ProjectionSlots, request_slots: list[int], num_scheduled: list[int], seed: int):
    """(kernel result, float32 reference, y before) for requests already ordered by slot."""
    order = np.array(request_slots)
    counts = np.array(num_scheduled)
    batch = plan_lora_batch(order, counts, CPU)
    num_tokens = int(counts.sum())
    dtype = slots.lora_a.dtype
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, slots.shape.in_features, generator=generator).to(dtype)
    y = torch.randn(num_tokens, slots.shape.out_features, generator=generator).to(dtype)
    got = y.clone()
    slots.add_delta(got, x, batch)
    token_slots = torch.from_numpy(np.repeat(order, counts))
    # The reference in float32 on the very same (possibly bfloat16-valued) numbers
    # (a copy of y: .float() of a float32 tensor is the tensor itself).
    expected = add_lora_reference(
        y.float().clone(), x.float(), slots.lora_a.float(), slots.lora_b.float(), token_slots
    )
    return got, expected, y, token_slots


def test_plan_merges_requests_of_one_slot() -> None:
    # Requests in scheduler order: slot per request (-1: base) and tokens scheduled.
    request_slots = np.array([2, NO_ADAPTER, 0, 2, 1, NO_ADAPTER, 0])
    num_scheduled = np.array([3, 2, 1, 1, 4, 1, 2])
    order = order_by_slot(request_slots)
    request_slots, num_scheduled = request_slots[order], num_scheduled[order]
    assert list(request_slots) == [NO_ADAPTER, NO_ADAPTER, 0, 0, 1, 2, 2]
    batch = plan_lora_batch(request_slots, num_scheduled, CPU)
    # Requests of one slot merge into one segment; base tokens are in none.
    assert batch.segments == [(3, 6, 0), (6, 10, 1), (10, 14, 2)]
    assert batch.segment_table is not None
    assert batch.segment_table.tolist() == [list(s) for s in batch.segments]


# Requests ordered by slot with their token counts: decode (1 token each), uneven
# prefill chunks (past the kernel's 4- and 8-token groups), one adapter alone,
# a single token (the kernel then splits the output rows over threads), all base.
LAYOUTS = {
    "mixed": ([-1, -1, 0, 0, 1, 2, 2], [2, 1, 1, 2, 4, 1, 3]),
    "decode": ([-1, 0, 0, 0, 1, 1, 2], [1] * 7),
    "uneven": ([-1, 0, 1, 2], [3, 17, 9, 5]),
    "one_adapter": ([2, 2], [6, 7]),
    "one_token": ([0], [1]),
    "all_base": ([-1, -1], [3, 1]),
}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    """Run with 1 and with 2 torch threads (the kernel's work split differs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_float32_equals_the_reference(kernel: str, shape: str, layout: str, threads: int) -> None:
    slots = _slots(SHAPES[shape], kernel, torch.float32)
    got, expected, y, token_slots = _run(slots, *LAYOUTS[layout], seed=len(layout))
    # Only the order of float32 sums differs from the reference: every element
    # within 1e-6 of the largest delta (8 float32 ulps of it; both paths measure
    # at most 2.6e-7, the torch path as far from the reference as the kernel).
    scale = float((expected - y).abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * scale)
    base = token_slots < 0
    assert torch.equal(got[base], y[base])  # base tokens untouched, bit for bit
    if not base.all():
        assert not torch.allclose(got[~base], y[~base])


@pytest.mark.parametrize("layout", ["mixed", "uneven", "one_token"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_native_rounds_once(shape: str, layout: str, threads: int) -> None:
    # The kernel accumulates in float32 and rounds y + delta once: within one
    # bfloat16 ulp of the float32 reference rounded, almost always equal to it.
    slots = _slots(SHAPES[shape], "native", torch.bfloat16)
    got, expected, y, token_slots = _run(slots, *LAYOUTS[layout], seed=7)
    assert_bf16_close(got, expected.to(torch.bfloat16), max_ulps=1, min_identical=0.95)
    base = token_slots < 0
    assert torch.equal(got[base], y[base])


def test_bfloat16_torch_path_is_close() -> None:
    # The fallback rounds the shrink to bfloat16 too: close, not one rounding.
    slots = _slots(WIDE, "torch", torch.bfloat16)
    got, expected, _, _ = _run(slots, *LAYOUTS["mixed"], seed=3)
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_slice_the_adapter_does_not_target_gets_no_delta(kernel: str) -> None:
    slots = _slots(SHAPE, kernel, torch.float32)
    slots.fill(0, _adapter(SHAPE, 3, ("k_proj",), 5), 0)  # refill: stale columns cleared
    x = torch.randn(2, SHAPE.in_features)
    y = torch.zeros(2, SHAPE.out_features)
    slots.add_delta(y, x, plan_lora_batch(np.array([0]), np.array([2]), CPU))
    assert torch.count_nonzero(y[:, :8]) == 0 and torch.count_nonzero(y[:, 12:]) == 0
    assert torch.count_nonzero(y[:, 8:12]) == 8


def test_native_kernel_checks_its_tables() -> None:
    slots = _slots(SHAPE, "native", torch.float32)
    x, y = torch.randn(3, SHAPE.in_features), torch.zeros(3, SHAPE.out_features)
    past_end = LoRABatch([(0, 4, 0)], segment_table=torch.tensor([[0, 4, 0]]))
    with pytest.raises(RuntimeError, match="out of range"):
        slots.add_delta(y, x, past_end)
    with pytest.raises(RuntimeError, match="share one dtype"):
        slots.add_delta(y, x.double(), LoRABatch([], segment_table=torch.zeros(0, 3).long()))


def test_kernel_choice_says_why_not() -> None:
    assert "float16" in (native_lora_unavailable_reason(CPU, torch.float16) or "")
    assert "cuda" in (native_lora_unavailable_reason(torch.device("cuda"), torch.float32) or "")
    assert native_lora_unavailable_reason(CPU, torch.bfloat16) == native.unavailable_reason()
