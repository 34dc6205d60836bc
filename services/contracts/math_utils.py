"""Integer helpers shared by every service (block and tile arithmetic)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``: blocks needed for ``a`` tokens."""
    return -(a // -b)
