"""Batched LoRA: the Triton kernels (interpreter on CPU) equal the grouped torch reference.

``triton.jit`` reads TRITON_INTERPRET when a kernel module is first imported,
so it is set before anything imports ``kvmesh.kernels.triton_lora``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvmesh.kernels.lora_reference import add_lora_reference
from kvmesh.kernels.triton_backend import triton_interpret_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and not triton_interpret_enabled():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)

from kvmesh.kernels.triton_lora import add_lora_triton  # noqa: E402 - after the interpreter check


def _case(num_tokens: int, in_features: int, out_features: int, rank: int, slots: list[int]):
    generator = torch.Generator().manual_seed(num_tokens * 131 + rank)
    num_slots = 3

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE)

    x = randn(num_tokens, in_features)
    y = randn(num_tokens, out_features)
    lora_a = randn(num_slots, rank, in_features)
    lora_b = randn(num_slots, out_features, rank)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    return y, x, lora_a, lora_b, token_slots


@pytest.mark.parametrize(
    ("in_features", "out_features", "rank", "slots"),
    [
        (64, 96, 16, [0, 0, 1, -1, 2, 1, -1]),  # every slot and the base, interleaved
        (70, 33, 5, [2, 2, 2]),  # sizes off the block sizes, one adapter
        (32, 128, 24, [-1, -1]),  # base only: y unchanged
        (128, 64, 8, [1, -1, 0, 2, 2, 0, 1, -1, 1, 0, 2]),
    ],
)
def test_triton_lora_matches_reference(
    in_features: int, out_features: int, rank: int, slots: list[int]
) -> None:
    y, x, lora_a, lora_b, token_slots = _case(len(slots), in_features, out_features, rank, slots)
    expected = add_lora_reference(y.clone(), x, lora_a, lora_b, token_slots)
    got = add_lora_triton(y.clone(), x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-5)
    base_rows = token_slots < 0
    assert torch.equal(got[base_rows], y[base_rows])
    if not base_rows.all():
        assert not torch.allclose(got[~base_rows], y[~base_rows])


def test_reference_is_each_slot_alone() -> None:
    # Grouping by slot gives each token exactly its own adapter's delta.
    y, x, lora_a, lora_b, token_slots = _case(6, 16, 12, 4, [0, 1, -1, 1, 0, 2])
    got = add_lora_reference(y.clone(), x, lora_a, lora_b, token_slots)
    for t, slot in enumerate(token_slots.tolist()):
        delta = 0 if slot < 0 else lora_b[slot] @ (lora_a[slot] @ x[t])
        torch.testing.assert_close(got[t], y[t] + delta)
