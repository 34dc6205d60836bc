"""``python -m kvmesh`` is the ``kvmesh`` command (services/cli.py)."""

from __future__ import annotations

from services.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
