"""The shared-filesystem tier's file costs on a local directory: write, read, sweep.

Per block (4 KiB by default): ``SharedFsFiles.write`` (temp file + rename) against a
plain ``open/write/close`` of the same bytes, and ``read`` (open, read, CRC-32
check) against a plain ``open/read``. Per sweep: one listing of N files (stat of
each) under the bound, and one that evicts 10 % (two listings and the unlinks),
against ``os.walk`` + ``os.stat`` of the same tree. Each measured on the process
CPU-time clock and the wall clock, in alternating rounds so that a loaded machine
moves both sides alike; the ratios are what to read. A local disk, not NFS: on
NFS every file call is a round trip and the ratios to the plain calls still hold.

Run: .venv/bin/python benchmarks/shared_fs_bench.py [--files 20000] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.kvstore.block import RECORD_HEADER_BYTES, StoredBlock, crc32
from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.shared_fs_files import SharedFsFiles

LAYOUT = KVLayout(model="bench", dtype="float32", block_size=16, layout_version=1)


def key(i: int) -> bytes:
    return LAYOUT.block_key(i.to_bytes(8, "little") + b"h" * 24)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_round(root: Path, n: int, size: int) -> dict[str, tuple[float, float]]:
    data = os.urandom(size)
    block = StoredBlock(data, crc32(data))
    plain_dir = root / "plain"
    plain_dir.mkdir()
    (root / "tier").mkdir()
    files = SharedFsFiles(root / "tier")
    record = RECORD_HEADER_BYTES + size
    out: dict[str, tuple[float, float]] = {}

    def plain_writes() -> None:
        for i in range(n):
            with open(plain_dir / f"{i}.blk", "wb") as f:
                f.write(data)

    def tier_writes() -> None:
        for i in range(n):
            files.write(key(i), block)

    def plain_reads() -> None:
        for i in range(0, n, 10):
            with open(plain_dir / f"{i}.blk", "rb") as f:
                f.read()

    def tier_reads() -> None:
        for i in range(0, n, 10):
            files.read(key(i), 3600.0)

    def plain_listing() -> None:
        for directory, _, names in os.walk(files.base):
            for name in names:
                os.stat(os.path.join(directory, name))

    out["write/plain"], out["write/tier"] = timed(plain_writes), timed(tier_writes)
    out["read/plain"], out["read/tier"] = timed(plain_reads), timed(tier_reads)
    out["list/plain"] = timed(plain_listing)
    out["sweep/under bound"] = timed(lambda: files.sweep(2 * n * record, n * record))
    out["sweep/evict 10%"] = timed(
        lambda: files.sweep(int(0.95 * n * record), int(0.9 * n * record))
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            rounds.append(bench_round(Path(root), args.files, args.size))
    print(f"load average {os.getloadavg()[0]:.2f}; {args.files} files of {args.size} B")
    per = {"write": args.files, "read": args.files // 10, "list": args.files, "sweep": args.files}
    for name in rounds[0]:
        count = per[name.split("/")[0]]
        wall = statistics.median(r[name][0] for r in rounds) / count * 1e6
        cpu = statistics.median(r[name][1] for r in rounds) / count * 1e6
        print(f"{name:20s} {wall:8.1f} us wall {cpu:8.1f} us cpu per file")
    for op, plain in (("write", "write/plain"), ("read", "read/plain")):
        ratio = statistics.median(r[f"{op}/tier"][1] / r[plain][1] for r in rounds)
        print(f"{op}: tier / plain CPU time = {ratio:.2f}")
    for sweep in ("sweep/under bound", "sweep/evict 10%"):
        ratio = statistics.median(r[sweep][1] / r["list/plain"][1] for r in rounds)
        print(f"{sweep}: / os.walk+stat CPU time = {ratio:.2f}")


if __name__ == "__main__":
    main()
