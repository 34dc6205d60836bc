"""kvstore throughput over loopback gRPC, and the store's cost per operation as it grows.

1. Put and get GB/s through the real service: ``kvmesh serve kvstore`` in its
   own process (memory tier only), ``KVStoreClient`` in this one, one stream
   at a time, blocks of 64 KiB to 2 MiB, ~16 MiB per call. Baseline measured in
   the same run: zlib CRC-32 over the same bytes in this process (every byte
   is checksummed once on each side), printed as the ratio put/CRC, get/CRC.
2. The in-process TieredStore (memory tier) at 10k, 100k and 1M blocks of 64
   bytes: µs per put (begin + write + commit), get, lookup_prefix and lease +
   release (batches of 64 hashes, cost per block), and per put that evicts one
   block (store full, watermarks at 1). Flat across sizes means O(1) per
   operation; the baseline is a random lookup in a plain dict of as many keys
   (it grows too, with cache misses, which no data structure avoids).
   Memory: RSS growth per block while filling, with keys and payloads
   allocated beforehand, i.e. the store's own state per block
   (block record, table and LRU entries). Each size runs in a fresh forked
   process so RSS deltas do not mix.

Run: .venv/bin/python benchmarks/kvstore_bench.py [--sizes 10000,100000,1000000] [--mib 256]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from kvmesh.kvstore.block import crc32
from kvmesh.kvstore.client import KVStoreClient
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.services.cli.local_stack import free_ports
from kvmesh.services.runtime.grpc_security import InternalSecurity
from kvmesh.services.runtime.grpc_server import wait_until_serving

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout("bench-model", "bfloat16", 16, 1)
BLOCK_SIZES = (64 << 10, 256 << 10, 1 << 20, 2 << 20)
CALL_BYTES = 16 << 20
SMALL_BLOCK = 64
BATCH = 64


# -- 1. loopback gRPC throughput ------------------------------------------------


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


async def _throughput(address: str, block_size: int, total_bytes: int) -> tuple[float, float]:
    """(put GB/s, get GB/s) moving ``total_bytes`` in blocks of ``block_size``."""
    payload = os.urandom(block_size)
    per_call = max(1, CALL_BYTES // block_size)
    num_blocks = max(per_call, total_bytes // block_size)
    base = block_size << 32  # distinct hashes per block size
    calls = [
        [_hash(base + i) for i in range(start, min(start + per_call, num_blocks))]
        for start in range(0, num_blocks, per_call)
    ]
    async with KVStoreClient(address, timeout_s=60) as client:
        t0 = time.perf_counter()
        for hashes in calls:
            await client.put_blocks(LAYOUT, [(h, payload) for h in hashes])
        t1 = time.perf_counter()
        for hashes in calls:
            result = await client.get_blocks(LAYOUT, hashes)
            assert all(block is not None for block in result.blocks), "a block went missing"
        t2 = time.perf_counter()
        for hashes in calls:
            await client.delete(LAYOUT, hashes)
    moved = num_blocks * block_size
    return moved / (t1 - t0) / 1e9, moved / (t2 - t1) / 1e9


def _crc_gbps(total_bytes: int) -> float:
    data = os.urandom(1 << 20)
    t0 = time.perf_counter()
    for _ in range(total_bytes >> 20):
        zlib.crc32(data)
    return total_bytes / (time.perf_counter() - t0) / 1e9


async def bench_grpc(total_mib: int) -> None:
    port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.cli.main", "serve", "kvstore",
         "--kvstore-port", str(port), "--kvstore-metrics-port", str(metrics_port),
         "--kvstore-capacity-bytes", str(2 * total_mib << 20), "--log-level", "WARNING"],
        cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        await wait_until_serving(address, 60, InternalSecurity())
        crc = _crc_gbps(total_mib << 20)
        print(
            f"1. loopback gRPC, one stream, {total_mib} MiB per size; CRC-32 alone: {crc:.2f} GB/s"
        )
        print(f"{'block':>8} {'put GB/s':>9} {'get GB/s':>9} {'put/CRC':>8} {'get/CRC':>8}")
        for block_size in BLOCK_SIZES:
            put, get = await _throughput(address, block_size, total_mib << 20)
            label = f"{block_size >> 10} KiB"
            print(f"{label:>8} {put:9.2f} {get:9.2f} {put / crc:8.2f} {get / crc:8.2f}")
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- 2. in-process cost per operation -------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _per_op_us(fn: Callable[[], None], num_ops: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / num_ops * 1e6


def _put_all(store: TieredStore, keys: list[bytes], payloads: list[bytes]) -> None:
    for key, data in zip(keys, payloads, strict=True):
        pending = store.begin_put(key, SMALL_BLOCK)
        assert pending is not None
        pending.write(data)
        store.commit_put(pending, crc32(data))


def _store_costs(num_blocks: int) -> dict[str, float]:
    rng = random.Random(0)
    keys = [LAYOUT.block_key(_hash(i)) for i in range(num_blocks)]
    payloads = [i.to_bytes(8, "big") * (SMALL_BLOCK // 8) for i in range(num_blocks)]
    store = TieredStore(num_blocks * SMALL_BLOCK, high_watermark=1.0, low_watermark=1.0)
    rss_before = _rss_bytes()
    put_us = _per_op_us(lambda: _put_all(store, keys, payloads), num_blocks)
    overhead = (_rss_bytes() - rss_before) / num_blocks
    assert len(store.memory) == num_blocks
    batches = [rng.sample(keys, BATCH) for _ in range(min(num_blocks, 200_000) // BATCH)]
    num_batched = len(batches) * BATCH

    async def batched() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        for batch in batches:
            await store.get(batch)
        t1 = time.perf_counter()
        for batch in batches:
            await store.lookup_prefix([batch])
        t2 = time.perf_counter()
        for batch in batches:
            lease_id, _ = await store.lease(batch, 60.0)
            store.release(lease_id)
        t3 = time.perf_counter()
        return tuple((b - a) / num_batched * 1e6 for a, b in ((t0, t1), (t1, t2), (t2, t3)))

    get_us, lookup_us, lease_us = asyncio.run(batched())
    # Baseline: one random lookup in a plain dict of the same keys, same order.
    # Its growth with size is the memory hierarchy's (cache misses), not the store's.
    table = dict(zip(keys, payloads, strict=True))
    dict_us = _per_op_us(lambda: [table.get(k) for batch in batches for k in batch], num_batched)
    num_evicting = min(num_blocks, 100_000)
    new_keys = [LAYOUT.block_key(_hash(num_blocks + i)) for i in range(num_evicting)]
    evict_us = _per_op_us(lambda: _put_all(store, new_keys, payloads[:num_evicting]), num_evicting)
    assert store.memory.stats().evictions == num_evicting
    return {
        "put": put_us,
        "get": get_us,
        "lookup": lookup_us,
        "lease+release": lease_us,
        "put+evict": evict_us,
        "dict.get": dict_us,
        "bytes/block": overhead,
    }


def _store_costs_in_child(num_blocks: int, queue: multiprocessing.Queue) -> None:
    queue.put(_store_costs(num_blocks))


def bench_store(sizes: list[int]) -> None:
    print(f"\n2. in-process store, {SMALL_BLOCK}-byte blocks: µs per block (batches of {BATCH})")
    columns = ["put", "get", "lookup", "lease+release", "put+evict", "dict.get", "bytes/block"]
    print(f"{'blocks':>9} " + " ".join(f"{c:>13}" for c in columns))
    context = multiprocessing.get_context("fork")
    results = {}
    for num_blocks in sizes:
        queue = context.Queue()
        child = context.Process(target=_store_costs_in_child, args=(num_blocks, queue))
        child.start()
        results[num_blocks] = queue.get()
        child.join()
        row = results[num_blocks]
        print(f"{num_blocks:>9} " + " ".join(f"{row[c]:13.2f}" for c in columns))
    smallest, largest = results[sizes[0]], results[sizes[-1]]
    ratios = " ".join(f"{c}={largest[c] / smallest[c]:.2f}" for c in columns[:-1])
    print(f"cost ratio {sizes[-1]} / {sizes[0]} blocks (1.0 = flat): {ratios}")
    print("dict.get: baseline, a random lookup in a plain dict of as many keys")
    print("bytes/block: RSS growth per stored block, keys and payloads excluded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="store sizes in blocks")
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per block size")
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    asyncio.run(bench_grpc(args.mib))
    bench_store([int(n) for n in args.sizes.split(",")])


if __name__ == "__main__":
    main()
