"""The KV-aware router on a simulated fleet: decision latency, event ingestion, index memory.

For each fleet size (8, 64 and 256 replicas by default), in a fresh forked
process so RSS deltas do not mix:

1. Fill: every replica reports ``--blocks-per-replica`` cached blocks through
   its KV event stream (``Router.apply_kv_events`` on ``KVEventBatch``
   protos): a quarter of the 32 shared system prompts (64 blocks each, so
   replicas overlap, as they do behind a kv router) and unique conversation
   chains for the rest. Memory: RSS growth over the fill per cached
   (replica, block) entry, i.e. the index's bytes per block a replica holds,
   and the time of one full ``gc.collect()`` over it (the index must stay
   invisible to the collector, or every full collection pauses the gateway).
2. Churn (steady state): batches as a busy scheduler seals them, two
   ``BlockStored`` of 8 new blocks and two ``BlockRemoved`` of its 8 oldest
   each, for random replicas, serialized beforehand; timed: parse
   (``KVEventBatch.FromString``, what gRPC does) + apply. Printed as events
   and blocks ingested per second.
3. Decisions: ``Router.pick_by_keys`` (index lookups + the kv policy over
   every replica) for prompts of a shared system prompt plus 16-64 blocks,
   half of them a returning conversation cached on one replica; p50/p99.
   Hashing the prompt (sha256 chain, ``Router.prompt_keys``) does not
   depend on the fleet and is timed once, for a 2,048-token prompt.
   Baseline in the same run: the ``round-robin`` policy's decision (no index
   read), the floor any policy pays for its bookkeeping.

Block hashes are synthetic (a replica's blocks are numbered, so the oldest can
be evicted without keeping them): the index sees 32-byte hashes like the
scheduler's and cannot tell.

Run: .venv/bin/python benchmarks/router_bench.py [--sizes 8,64,256] [--blocks-per-replica 100000]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import random
import statistics
import time

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.prefix_index import block_key
from kvmesh.gateway.routing.router import Router
from kvmesh.protos import scheduler_pb2
from kvmesh.services.runtime.config import RoutingPolicyName

BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 32
SYSTEM_PROMPT_BLOCKS = 64
CHAIN_BLOCKS = 64  # blocks per stored event while filling
CHURN_BLOCKS = 8  # blocks per stored / removed event in steady state
NUM_CHURN_BATCHES = 20_000
NUM_DECISIONS = 3_000
# Namespace of the shared system prompts' blocks (replicas use 0..N-1).
SHARED = 1 << 20
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def block_hash(owner: int, number: int) -> bytes:
    """A 32-byte hash for block ``number`` of ``owner``: deterministic, so a
    replica's oldest blocks can be named again to evict them, and well mixed
    in the first 8 bytes (the index's key), like sha256."""
    mixed = ((owner << 40 | number) * _MIX) & _MASK64
    return mixed.to_bytes(8, "little") + owner.to_bytes(8, "little") + bytes(16)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class FleetStream:
    """Every replica's event stream: its sequence, and which numbered blocks it holds."""

    def __init__(self, num_replicas: int) -> None:
        self.sequence = [0] * num_replicas
        self.oldest = [0] * num_replicas  # first unique block still cached
        self.next = [0] * num_replicas  # next unique block number

    def batch(
        self, replica: int, events: list[scheduler_pb2.KVCacheEvent]
    ) -> scheduler_pb2.KVEventBatch:
        self.sequence[replica] += 1
        return scheduler_pb2.KVEventBatch(
            instance_id=1,
            sequence=self.sequence[replica],
            events=events,
            load=scheduler_pb2.ReplicaLoad(
                num_running=random.randint(8, 24),
                num_active_blocks=random.randint(500, 2000),
                num_kv_blocks=1 << 17,
            ),
        )

    def store_new(self, replica: int, count: int) -> scheduler_pb2.KVCacheEvent:
        first = self.next[replica]
        self.next[replica] += count
        hashes = [block_hash(replica, n) for n in range(first, first + count)]
        return stored_event(hashes)

    def remove_oldest(self, replica: int, count: int) -> scheduler_pb2.KVCacheEvent:
        first = self.oldest[replica]
        self.oldest[replica] += count
        hashes = [block_hash(replica, n) for n in range(first, first + count)]
        return scheduler_pb2.KVCacheEvent(removed=scheduler_pb2.BlockRemoved(block_hashes=hashes))


def stored_event(hashes: list[bytes]) -> scheduler_pb2.KVCacheEvent:
    stored = scheduler_pb2.BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE)
    return scheduler_pb2.KVCacheEvent(stored=stored)


def system_prompt_hashes(prompt: int) -> list[bytes]:
    first = prompt * SYSTEM_PROMPT_BLOCKS
    return [block_hash(SHARED, n) for n in range(first, first + SYSTEM_PROMPT_BLOCKS)]


def make_router(num_replicas: int, policy: str) -> Router:
    router = Router(RouterConfig(block_size=BLOCK_SIZE, policy=policy))
    for replica in range(num_replicas):
        router.add_replica(f"r{replica}")
        resync = scheduler_pb2.KVEventBatch(
            instance_id=1,
            resync=True,
            events=[scheduler_pb2.KVCacheEvent(all_cleared=scheduler_pb2.AllBlocksCleared())],
        )
        router.apply_kv_events(f"r{replica}", resync)
    return router


def fill(router: Router, stream: FleetStream, blocks_per_replica: int) -> tuple[float, int]:
    """Every replica's initial cache; returns (seconds applying, blocks applied)."""
    applying = 0.0
    applied = 0
    for replica in range(len(stream.sequence)):
        name = f"r{replica}"
        prompts = random.sample(range(NUM_SYSTEM_PROMPTS), NUM_SYSTEM_PROMPTS // 4)
        events = [stored_event(system_prompt_hashes(p)) for p in prompts]
        remaining = blocks_per_replica - len(prompts) * SYSTEM_PROMPT_BLOCKS
        while remaining > 0:
            count = min(CHAIN_BLOCKS, remaining)
            events.append(stream.store_new(replica, count))
            remaining -= count
        for start in range(0, len(events), 16):
            batch = stream.batch(replica, events[start : start + 16])
            t0 = time.perf_counter()
            router.apply_kv_events(name, batch)
            applying += time.perf_counter() - t0
        applied += blocks_per_replica
    return applying, applied


def churn(router: Router, stream: FleetStream) -> tuple[float, int, int]:
    """Steady-state batches; returns (seconds parsing + applying, events, blocks)."""
    num_replicas = len(stream.sequence)
    wire = []
    for _ in range(NUM_CHURN_BATCHES):
        replica = random.randrange(num_replicas)
        events = [
            stream.store_new(replica, CHURN_BLOCKS),
            stream.remove_oldest(replica, CHURN_BLOCKS),
            stream.store_new(replica, CHURN_BLOCKS),
            stream.remove_oldest(replica, CHURN_BLOCKS),
        ]
        wire.append((f"r{replica}", stream.batch(replica, events).SerializeToString()))
    t0 = time.perf_counter()
    for name, data in wire:
        router.apply_kv_events(name, scheduler_pb2.KVEventBatch.FromString(data))
    elapsed = time.perf_counter() - t0
    return elapsed, 4 * NUM_CHURN_BATCHES, 4 * CHURN_BLOCKS * NUM_CHURN_BATCHES


def decision_prompts(stream: FleetStream) -> list[list[int]]:
    """Keys of prompts: a system prompt, then a returning conversation (cached on
    one replica) or a new one."""
    prompts = []
    for index in range(NUM_DECISIONS):
        keys = [block_key(h) for h in system_prompt_hashes(random.randrange(NUM_SYSTEM_PROMPTS))]
        length = random.randint(16, 64)
        if index % 2:
            replica = random.randrange(len(stream.sequence))
            first = random.randrange(stream.oldest[replica], stream.next[replica] - length)
            keys += [block_key(block_hash(replica, n)) for n in range(first, first + length)]
        else:
            keys += [block_key(os.urandom(32)) for _ in range(length)]
        prompts.append(keys)
    return prompts


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def time_decisions(router: Router, prompts: list[list[int]]) -> dict[str, float]:
    """p50 and p99 of pick_by_keys in µs, wall clock and this thread's CPU time
    (the shared dev box preempts the process for milliseconds at a time)."""
    wall, cpu = [], []
    for keys in prompts:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        router.pick_by_keys(keys, len(keys) * BLOCK_SIZE)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        wall.append((w1 - w0) / 1000)
        cpu.append((c1 - c0) / 1000)
    (p50, p99), (cpu_p50, cpu_p99) = percentiles(wall), percentiles(cpu)
    return {"p50": p50, "p99": p99, "cpu_p50": cpu_p50, "cpu_p99": cpu_p99}


def run_size(num_replicas: int, blocks_per_replica: int, results: dict) -> None:
    random.seed(num_replicas)
    router = make_router(num_replicas, RoutingPolicyName.KV)
    stream = FleetStream(num_replicas)
    rss_before = rss_bytes()
    fill_s, filled = fill(router, stream, blocks_per_replica)
    index_bytes = rss_bytes() - rss_before
    t0 = time.perf_counter()
    gc.collect()
    gc_ms = (time.perf_counter() - t0) * 1000
    churn_s, events, blocks = churn(router, stream)
    prompts = decision_prompts(stream)
    kv = time_decisions(router, prompts)
    rr = time_decisions(make_router(num_replicas, RoutingPolicyName.ROUND_ROBIN), prompts)
    results.update(
        **kv,
        rr_cpu_p99=rr["cpu_p99"],
        replicas=num_replicas,
        cached=filled,
        distinct=router.index.num_keys,
        bytes_per_block=index_bytes / filled,
        gc_ms=gc_ms,
        fill_blocks_per_s=filled / fill_s,
        events_per_s=events / churn_s,
        blocks_per_s=blocks / churn_s,
    )


def run_in_child(num_replicas: int, blocks_per_replica: int) -> dict:
    with multiprocessing.Manager() as manager:
        results = manager.dict()
        child = multiprocessing.get_context("fork").Process(
            target=run_size, args=(num_replicas, blocks_per_replica, results)
        )
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"{num_replicas} replicas: child exited with {child.exitcode}")
        return dict(results)


def time_hashing() -> float:
    """µs to hash a 2,048-token prompt into index keys (independent of the fleet)."""
    router = Router(RouterConfig(block_size=BLOCK_SIZE))
    prompt = [random.randrange(50_000) for _ in range(2048)]
    runs = 200
    t0 = time.perf_counter()
    for _ in range(runs):
        router.prompt_keys(prompt)
    return (time.perf_counter() - t0) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64,256", help="fleet sizes, comma-separated")
    parser.add_argument("--blocks-per-replica", type=int, default=100_000)
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"block size {BLOCK_SIZE}; {args.blocks_per_replica} cached blocks per replica")
    header = (
        f"{'replicas':>8} {'cached':>11} {'distinct':>10} {'B/block':>8} {'gc ms':>6} "
        f"{'fill blk/s':>11} {'events/s':>9} {'blocks/s':>10} {'p50 µs':>7} {'p99 µs':>7} "
        f"{'cpu p50':>7} {'cpu p99':>7} {'rr cpu p99':>10}"
    )
    print(header)
    for size in (int(s) for s in args.sizes.split(",")):
        r = run_in_child(size, args.blocks_per_replica)
        print(
            f"{r['replicas']:>8} {r['cached']:>11,} {r['distinct']:>10,} "
            f"{r['bytes_per_block']:>8.0f} {r['gc_ms']:>6.1f} {r['fill_blocks_per_s']:>11,.0f} "
            f"{r['events_per_s']:>9,.0f} {r['blocks_per_s']:>10,.0f} {r['p50']:>7.1f} "
            f"{r['p99']:>7.1f} {r['cpu_p50']:>7.1f} {r['cpu_p99']:>7.1f} "
            f"{r['rr_cpu_p99']:>10.1f}",
            flush=True,
        )
    print(f"hashing a 2,048-token prompt (128 blocks, sha256 chain): {time_hashing():.0f} µs")
    print("cached: (replica, block) entries; distinct: different blocks over the fleet")
    print("B/block: RSS growth over the fill per cached entry (the index's memory)")
    print("gc ms: one full gc.collect() with the fleet indexed (the pause it adds to the gateway)")
    print("events/s, blocks/s: steady-state batches parsed from bytes and applied")
    print("p50/p99: kv decision (pick_by_keys), wall clock; cpu: the same in thread CPU time")
    print("rr cpu p99: round-robin's decision, the bookkeeping floor of any policy")


if __name__ == "__main__":
    main()
