"""``python -m kvmesh`` is the ``kvmesh`` command (services/cli/main.py)."""

from __future__ import annotations

from kvmesh.services.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
