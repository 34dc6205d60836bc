"""``python -m services.config``: the declared environment, for people and shell scripts.

python -m services.config list        # every process setting: name, type, default, use
python -m services.config get NAME    # its value here, as text (how scripts read one)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.config.options import as_env_text
from services.config.process import ENV_SETTINGS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.config", description=__doc__)
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
