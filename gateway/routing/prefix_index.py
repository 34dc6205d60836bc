"""Which replicas hold which cached blocks, as told by their KV events.

Keyed by block hash, which names a whole prefix (the hashes are chained), so
a replica's overlap with a prompt is the run of the prompt's leading block
hashes it holds. Each key maps to a bitmask of replica slots (small ints the
router hands out), so one lookup per prompt block narrows every replica at
once; each slot keeps its own keys, so dropping a replica or applying its
clear costs O(its blocks).

Both maps are dicts of ints (a slot's keys map to None), never sets: the
garbage collector does not track a dict that holds only ints and None, while
it walks every element of a set on each full collection, which with millions
of cached blocks is a pause of a second.

Keys are the first 60 bits of the block hash (a 32-byte int object instead of
a 65-byte bytes object, per entry). Two different prefixes share a key with
probability 2^-60 per pair: at worst a wrong overlap estimate, which costs a
worse routing choice, never a wrong output (the replica checks its own cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

_KEY_MASK = (1 << 60) - 1


def block_key(block_hash: bytes) -> int:
    """The index's key for a block hash."""
    return int.from_bytes(block_hash[:8], "little") & _KEY_MASK


def iter_slots(mask: int) -> Iterator[int]:
    """The slots whose bits are set in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndexError(RuntimeError):
    """The index contradicts itself (a bug, never an event's fault)."""


class PrefixIndex:
    """Block key -> slots holding it, and slot -> its keys.

    Applying a replica's events in order keeps its entry equal to the
    replica's prefix cache: storing a held key or removing a missing one is a
    no-op, so a resync snapshot may overlap what is known.
    """

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._keys_of: dict[int, dict[int, None]] = {}

    def store(self, slot: int, keys: Iterable[int]) -> None:
        bit = 1 << slot
        holders = self._holders
        mine = self._keys_of.setdefault(slot, {})
        for key in keys:
            if key not in mine:
                mine[key] = None
                holders[key] = holders.get(key, 0) | bit

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        mine = self._keys_of.get(slot)
        if not mine:
            return
        for key in keys:
            if key in mine:
                del mine[key]
                self._drop_holder(key, slot)

    def clear(self, slot: int) -> None:
        """Forget every block of ``slot`` (its cache was reset, or it left)."""
        for key in self._keys_of.pop(slot, ()):
            self._drop_holder(key, slot)

    def _drop_holder(self, key: int, slot: int) -> None:
        mask = self._holders[key] & ~(1 << slot)
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def overlaps(self, keys: Sequence[int], candidates: int) -> dict[int, int]:
        """Leading blocks of ``keys`` held by each slot in the ``candidates``
        bitmask; slots holding none are left out."""
        if not keys:
            return {}
        holders = self._holders
        active = candidates
        found: dict[int, int] = {}
        for depth, key in enumerate(keys):
            held = holders.get(key, 0) & active
            if held != active:
                if depth:
                    for slot in iter_slots(active ^ held):
                        found[slot] = depth
                active = held
                if not active:
                    return found
        for slot in iter_slots(active):
            found[slot] = len(keys)
        return found

    def num_blocks(self, slot: int) -> int:
        return len(self._keys_of.get(slot, ()))

    def keys_of(self, slot: int) -> frozenset[int]:
        return frozenset(self._keys_of.get(slot, ()))

    @property
    def num_keys(self) -> int:
        """Distinct blocks known, over all slots."""
        return len(self._holders)

    def check_integrity(self) -> None:
        """Raise PrefixIndexError unless both maps say the same thing."""
        entries = 0
        for slot, keys in self._keys_of.items():
            bit = 1 << slot
            for key in keys:
                if not self._holders.get(key, 0) & bit:
                    raise PrefixIndexError(f"slot {slot} lists key {key:x}, the key map does not")
            entries += len(keys)
        if entries != sum(mask.bit_count() for mask in self._holders.values()):
            raise PrefixIndexError("the key map holds entries no slot lists")
