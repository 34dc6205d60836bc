"""Any sequence of memory-tier operations keeps the store's invariants.

After every step: bytes_used <= capacity and matches the blocks plus the
in-flight reservations; every block is leased or in the LRU queue, never both
(``check_integrity``); no block is visible that was never committed, and a
visible block holds exactly the bytes committed under its key; every block of
a live lease is still there.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.kvstore.block import PutOutcome, crc32
from kvmesh.kvstore.memory_tier import MemoryTier
from kvmesh.kvstore.pending_put import PendingPut
from kvmesh.kvstore.testing import FakeClock

NUM_KEYS = 8
CAPACITY = 1000


def key(i: int) -> bytes:
    return bytes([i]) * 4


def payload(i: int) -> bytes:
    # One size and content per key, as for real content-addressed blocks.
    return bytes([i + 1]) * (60 + 45 * i)


keys = st.integers(0, NUM_KEYS - 1)


class MemoryTierMachine(RuleBasedStateMachine):
    @initialize(high=st.floats(0.5, 1.0), gap=st.floats(0.0, 0.4))
    def setup(self, high: float, gap: float) -> None:
        self.clock = FakeClock()
        self.tier = MemoryTier(
            CAPACITY, high_watermark=high, low_watermark=max(0.1, high - gap), clock=self.clock
        )
        self.pending: list[PendingPut] = []
        self.committed: set[bytes] = set()
        # lease id -> (keys pinned, expiry)
        self.leases: dict[int, tuple[list[bytes], float]] = {}

    @rule(i=keys)
    def begin(self, i: int) -> None:
        pending = self.tier.begin_put(key(i), len(payload(i)))
        if pending is not None:
            self.pending.append(pending)

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100), fraction=st.floats(0, 1))
    def write(self, index: int, fraction: float) -> None:
        pending = self.pending[index % len(self.pending)]
        data = payload(pending.key[0])
        end = pending.received + int((len(data) - pending.received) * fraction)
        pending.write(data[pending.received : end])

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100), corrupt=st.booleans())
    def commit(self, index: int, corrupt: bool) -> None:
        pending = self.pending.pop(index % len(self.pending))
        data = payload(pending.key[0])
        if not corrupt:
            pending.write(data[pending.received :])
        outcome = self.tier.commit_put(pending, crc32(data) ^ corrupt)
        assert (outcome is PutOutcome.CORRUPT) == corrupt
        if outcome is PutOutcome.STORED:
            self.committed.add(pending.key)

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100))
    def abort(self, index: int) -> None:
        self.tier.abort_put(self.pending.pop(index % len(self.pending)))

    @rule(i=keys)
    def get(self, i: int) -> None:
        block = self.tier.get(key(i))
        assert block is None or block.data == payload(i)

    @rule(i=keys)
    def delete(self, i: int) -> None:
        self.tier.delete([key(i)])

    @rule(chosen=st.lists(keys, max_size=3), ttl=st.floats(0.1, 20))
    def lease(self, chosen: list[int], ttl: float) -> None:
        lease_keys = [key(i) for i in chosen]
        lease_id, pinned = self.tier.lease(lease_keys, ttl)
        held = [k for k, p in zip(lease_keys, pinned, strict=True) if p]
        self.leases[lease_id] = (held, self.clock.now + ttl)

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        lease_id = sorted(self.leases)[index % len(self.leases)]
        _, expiry = self.leases.pop(lease_id)
        assert self.tier.release(lease_id) == (expiry > self.clock.now)

    @rule(seconds=st.floats(0, 10))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def consistent(self) -> None:
        stats = self.tier.stats()  # expires due leases first
        assert stats.bytes_used <= CAPACITY
        self.tier.check_integrity()
        for i in range(NUM_KEYS):
            if self.tier.contains(key(i)):
                assert key(i) in self.committed, "a block visible before any commit"
        for held, expiry in self.leases.values():
            if expiry > self.clock.now:
                assert all(self.tier.contains(k) for k in held), "a leased block vanished"


MemoryTierMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
test_memory_tier_invariants = MemoryTierMachine.TestCase
