"""Distances in units in the last place, for comparing low-precision kernels to torch."""

from __future__ import annotations

import torch


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable bfloat16 values lie between each pair (0: bit-identical).

    The sign-magnitude bit patterns are mapped onto a line that is monotone in
    value (-0 and +0 both at 0), so neighbours differ by 1 across every binade
    and across zero.
    """
    assert actual.dtype == expected.dtype == torch.bfloat16

    def ordinal(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordinal(actual) - ordinal(expected)).abs()


def assert_bf16_close(
    actual: torch.Tensor, expected: torch.Tensor, max_ulps: int, min_identical: float = 0.99
) -> None:
    """Every element within ``max_ulps`` bfloat16 ulps, and at least ``min_identical`` equal.

    When the kernel and torch round at the same points, they differ only in
    float32 details below bfloat16's resolution (the order of a sum, a few-ulp
    exp), which can move a value across one rounding boundary: 1 ulp, or 2
    where that rounded value is then multiplied and rounded again. The share
    of identical elements catches a missing or extra rounding step, which
    moves about a quarter of all values by 1 ulp.
    """
    distance = ulp_distance(actual, expected)
    assert int(distance.max()) <= max_ulps, f"{int(distance.max())} ulps apart"
    identical = float((distance == 0).float().mean())
    assert identical >= min_identical, f"only {identical:.4f} bit-identical"
