"""The ``kvmesh`` command: run the stack, one service, the model preparation, or a benchmark."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvmesh.services.runtime.config import (
    SERVICE_CONFIGS,
    add_config_arguments,
    config_from_namespace,
)

# Module whose ``serve(config, stop_event)`` runs each service.
SERVICE_MODULES = {
    "gateway": "kvmesh.gateway.server",
    "scheduler": "kvmesh.scheduler.server",
    "worker": "kvmesh.worker.server",
    "detokenizer": "kvmesh.detokenizer.server",
    "kvstore": "kvmesh.kvstore.server",
}


def _serve(service: str, args: argparse.Namespace) -> int:
    from kvmesh.services.runtime.lifecycle import run_service

    config = config_from_namespace(SERVICE_CONFIGS[service], args)
    module = importlib.import_module(SERVICE_MODULES[service])
    run_service(service, config.log_level, lambda stop: module.serve(config, stop))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag except ``bench``'s own (services/cli/bench/cli.py owns those);
    parsing runs nothing, so tests check documented command lines against it."""
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from kvmesh.services.cli.launcher import add_up_arguments

    up = commands.add_parser("up", help="start the whole stack as processes")
    add_up_arguments(up)

    serve = commands.add_parser("serve", help="run one service in this process")
    services = serve.add_subparsers(dest="service", required=True)
    for name, cls in SERVICE_CONFIGS.items():
        add_config_arguments(services.add_parser(name, help=(cls.__doc__ or "").strip()), cls)

    commands.add_parser("prepare-model", help="convert the default model once (idempotent)")
    commands.add_parser(
        "k8s-secret", help="print the Kubernetes Secrets of a stack with fresh credentials"
    )

    bench = commands.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The load generator owns its flags entirely (argparse's REMAINDER would
        # refuse options right after the subcommand).
        from kvmesh.services.cli.bench_command import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        from kvmesh.services.cli.launcher import run_up

        return run_up(args)
    if args.command == "serve":
        return _serve(args.service, args)
    if args.command == "prepare-model":
        from kvmesh.services.runtime.model_prep import prepare_default_model

        print(prepare_default_model())
        return 0
    if args.command == "k8s-secret":
        from kvmesh.services.cli.k8s_secret import main as k8s_secret_main

        return k8s_secret_main()
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
