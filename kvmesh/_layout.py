"""Where ``kvmesh.<package>`` lives: beside this package in a checkout, inside it when installed.

The wheel installs every package under ``kvmesh/`` (pyproject's package-dir), so no
generic top-level name (``kernels``, ``services``...) lands in site-packages. In a
checkout, or an editable install, the folders stay at the repository's top
(``./gateway``): the namespace's search path gets the repository root, so
``kvmesh.gateway`` resolves to ``./gateway`` without an install.
"""

from __future__ import annotations

import sys
from pathlib import Path

_package = sys.modules[__name__.rpartition(".")[0]]
_here = Path(__file__).resolve().parent
if not (_here / "gateway").is_dir() and (_here.parent / "gateway" / "__init__.py").is_file():
    _package.__path__.append(str(_here.parent))
