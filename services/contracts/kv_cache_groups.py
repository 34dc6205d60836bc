"""KV-cache groups: a model's layers grouped by attention type (vLLM v1's hybrid KV cache).

Layers with the same attention (full, or a sliding window of ``w`` tokens)
share a group, and each group has its own block table per request, its blocks
taken from the one shared pool. A sliding-window group needs only the blocks
inside its window, so it gives the older ones back while the request runs.

Every group has the same number of layers (``group_size``), so a block id is
one page in each of ``group_size`` K/V tensor pairs: the layer at position
``j`` of any group reads and writes tensor pair ``j`` at its own group's block
ids, and a block belongs to exactly one group at a time. A type with more
layers than ``group_size`` is split into several groups of that type; a group
with fewer layers (the last chunk) leaves the rest of its pages unused. A
model with one attention type has one group holding every layer: its cache is
laid out exactly as without groups.

A shared contract: the worker lays its tensors out by it, the scheduler does
its block arithmetic by it, and the worker tells the scheduler the windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.services.contracts.math_utils import cdiv

# Group sizes closer than this ratio use the largest type's layer count as the
# group size (fewer groups, a little padding) rather than the smallest's.
_PAD_RATIO = 1.25


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    # Attention over the last ``sliding_window`` tokens (None: every token).
    sliding_window: int | None
    # Model layer indices (global), ascending; layer ``layers[j]`` uses tensor pair j.
    layers: tuple[int, ...]


def group_layers(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """Group layers by their window (``windows[i]`` is layer i's; None: full
    attention). Full attention comes first, then windows in ascending order, so
    a model with a full-attention layer has it in group 0."""
    if not windows:
        raise ValueError("a model has at least one layer")
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and window <= 0:
            raise ValueError(f"layer {layer}: sliding window must be positive, got {window}")
        by_type.setdefault(window, []).append(layer)
    order = sorted(by_type, key=lambda w: -1 if w is None else w)
    counts = [len(by_type[w]) for w in order]
    group_size = min(counts)
    if max(counts) < group_size * _PAD_RATIO:
        group_size = max(counts)
    groups: list[KVCacheGroup] = []
    for window in order:
        layers = by_type[window]
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroup(window, tuple(layers[start : start + group_size])))
    return tuple(groups)


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Tensor pairs the cache holds: the layers of the largest group."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """Per model layer, (its group, its tensor pair)."""
    slots: list[tuple[int, int] | None] = [None] * num_layers
    for index, group in enumerate(groups):
        for position, layer in enumerate(group.layers):
            slots[layer] = (index, position)
    missing = [layer for layer, slot in enumerate(slots) if slot is None]
    if missing:
        raise ValueError(f"layers {missing} are in no KV-cache group")
    return [slot for slot in slots if slot is not None]


def windows_from_wire(windows: Sequence[int]) -> tuple[int | None, ...]:
    """``WorkerInfo.kv_cache_group_windows`` as windows (0: full attention;
    nothing, from a worker that predates groups: one full-attention group)."""
    return tuple(w or None for w in windows) or (None,)


def num_skipped_blocks(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query from position ``num_computed_tokens`` on reads:
    a query at p attends keys j with p - window < j <= p, so every slot before
    ``num_computed_tokens - window + 1`` is out of every future window."""
    if window is None:
        return 0
    return max(num_computed_tokens - window + 1, 0) // block_size


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a prefix hit of a windowed group must hold right before its end:
    the next query sees the ``window - 1`` keys before it."""
    return cdiv(window - 1, block_size)


def max_blocks_per_request(
    windows: Sequence[int | None], max_model_len: int, block_size: int, max_chunk_tokens: int
) -> int:
    """The most blocks one request can hold at once, over all groups: a full
    group's whole length; a windowed group's window plus the step's chunk of
    up to ``max_chunk_tokens`` plus the block a window edge straddles
    (bounded by the whole length)."""
    full = cdiv(max_model_len, block_size)
    windowed = cdiv(max_chunk_tokens, block_size) + 1
    return sum(
        full if window is None else min(full, cdiv(window, block_size) + windowed)
        for window in windows
    )


def longest_fitting_len(
    windows: Sequence[int | None],
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    max_chunk_tokens: int,
) -> int:
    """The longest length up to ``max_model_len`` one request can reach alone in
    a pool of ``num_blocks`` (the null block, reserved with any window, not
    counted); 0 when not even one token fits."""
    usable = num_blocks - int(any(w is not None for w in windows))

    def fits(length: int) -> bool:
        return max_blocks_per_request(windows, length, block_size, max_chunk_tokens) <= usable

    low, high = 0, max_model_len  # fits(low) holds (0 blocks); find the largest
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
