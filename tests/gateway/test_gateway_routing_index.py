"""The router's prefix index equals the replicas' real prefix caches once their streams
are caught up, whatever interleaving of steps, lost batches, dropped streams,
replays, resyncs, cache resets and restarts came before."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.prefix_index import PrefixIndex, block_key
from kvmesh.gateway.routing.router import Router
from tests.gateway.routing_sim import BLOCK_SIZE, SimReplica, block_hashes

# A few shared prefixes so that replicas hold the same blocks, and hits happen.
PREFIXES = [list(range(100 * p, 100 * p + 8)) for p in range(3)]

replica = st.integers(0, 2)
# A prompt computed on a replica (prefix, suffix length, suffix seed), and
# whether the step ends right after it (events sealed into a batch).
serve_op = st.tuples(
    st.just("serve"),
    replica,
    st.integers(0, len(PREFIXES)),
    st.integers(0, 12),
    st.integers(0, 1000),
    st.booleans(),
)
ops = st.lists(
    st.one_of(
        serve_op,
        serve_op,
        serve_op,
        st.tuples(st.sampled_from(["seal", "report_load"]), replica),
        st.tuples(st.just("deliver"), replica, st.integers(1, 3)),
        st.tuples(st.sampled_from(["lose", "drop"]), replica),
        st.tuples(st.sampled_from(["reset", "restart"]), replica),
    ),
    min_size=20,
    max_size=80,
)


def prompt(prefix: int, suffix_len: int, seed: int) -> list[int]:
    head = PREFIXES[prefix] if prefix < len(PREFIXES) else []
    return head + [(seed + i) % 50 for i in range(suffix_len)]


def assert_index_matches(router: Router, replicas: list[SimReplica]) -> None:
    for sim in replicas:
        if sim.caught_up(router):
            slot = router.replica(sim.name).slot
            assert router.index.keys_of(slot) == sim.cached_keys(), sim.name


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([1, 4, 16, 64]))
def test_index_equals_replica_caches_after_any_interleaving(
    operations: list[tuple], max_replay_blocks: int
) -> None:
    router = Router(RouterConfig(block_size=BLOCK_SIZE))
    replicas = [SimReplica(f"r{i}", max_replay_blocks=max_replay_blocks) for i in range(3)]
    for sim in replicas:
        router.add_replica(sim.name)
        sim.reconnect(router.resume_request(sim.name))
        sim.deliver(router)
    for op in operations:
        sim = replicas[op[1]]
        match op[0]:
            case "serve":
                sim.serve(prompt(op[2], op[3], op[4]))
                if op[5]:
                    sim.seal()
            case "seal":
                sim.seal()
            case "report_load":
                sim.report_load()
            case "deliver":
                sim.deliver(router, op[2])
            case "lose":  # one batch vanishes: the feed must notice the gap
                if sim.wire:
                    sim.wire.popleft()
            case "drop":  # the stream breaks; the subscriber reopens it
                sim.reconnect(router.resume_request(sim.name))
            case "reset":
                sim.pool.reset_prefix_cache()
            case "restart":
                sim.restart()
        router.index.check_integrity()
        assert_index_matches(router, replicas)
    for sim in replicas:
        # Quiet from now on: the last batch, then heartbeats; a gap they reveal
        # reopens the stream, which then replays or resyncs.
        sim.seal()
        sim.report_load()
        sim.deliver(router)
        sim.deliver(router)
        assert sim.caught_up(router)
    assert_index_matches(router, replicas)


def test_overlap_is_the_run_of_leading_blocks_held() -> None:
    index = PrefixIndex()
    keys = [block_key(h) for h in block_hashes(list(range(20)))]
    index.store(0, keys[:5])
    index.store(1, keys[:2] + keys[3:5])  # block 2 evicted: blocks 3, 4 cannot hit
    index.store(2, keys[1:5])  # no first block: nothing hits
    assert index.overlaps(keys, 0b111) == {0: 5, 1: 2}
    assert index.overlaps(keys, 0b110) == {1: 2}
    assert index.overlaps(keys[:3], 0b111) == {0: 3, 1: 2}
    assert index.overlaps([], 0b111) == {}


def test_removing_a_replica_forgets_only_its_blocks() -> None:
    index = PrefixIndex()
    keys = [block_key(h) for h in block_hashes(list(range(16)))]
    index.store(0, keys)
    index.store(5, keys[:2])
    index.clear(0)
    index.check_integrity()
    assert index.overlaps(keys, 0b100001) == {5: 2}
    assert index.num_keys == 2
    index.remove(5, keys)
    assert index.num_keys == 0


def test_the_index_is_invisible_to_the_garbage_collector() -> None:
    """Millions of entries in containers the collector walks would pause the
    gateway for a second on every full collection."""
    index = PrefixIndex()
    keys = [block_key(h) for h in block_hashes(list(range(64)))]
    index.store(0, keys)
    index.store(3, keys[:4])
    index.remove(3, keys[:1])
    # The two maps whose size grows with the cached blocks.
    assert not gc.is_tracked(index._holders)
    assert not any(gc.is_tracked(keys_of) for keys_of in index._keys_of.values())
