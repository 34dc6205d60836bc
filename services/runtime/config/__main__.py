"""``python -m kvmesh.services.runtime.config``: the declared environment, for people and scripts.

python -m kvmesh.services.runtime.config list      # every process setting: name, type, default
python -m kvmesh.services.runtime.config get NAME  # its value here, as text (how scripts read one)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvmesh.services.runtime.config.options import as_env_text
from kvmesh.services.runtime.config.process import ENV_SETTINGS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.services.runtime.config", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every process setting")
    get = commands.add_parser("get", help="one setting's value here")
    get.add_argument("name", choices=sorted(ENV_SETTINGS))
    args = parser.parse_args(argv)
    if args.command == "get":
        print(as_env_text(ENV_SETTINGS[args.name].get()))
        return 0
    for s in ENV_SETTINGS.values():
        print(f"{s.name} ({s.type.__name__}, default {s.default!r}): {s.help}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
