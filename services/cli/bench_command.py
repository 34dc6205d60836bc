"""``kvmesh bench ARGS...``: hands the arguments to the load generator (services/cli/bench/)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from kvmesh.services.cli.bench.cli import main as bench_main

    # `kvmesh bench -- --flag ...` reaches us with the separator still in front.
    return bench_main(argv[1:] if argv[:1] == ["--"] else argv)
