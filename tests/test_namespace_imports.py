"""Every first-party import names the ``kvmesh`` namespace (``kvmesh.gateway``, not ``gateway``).

In a checkout the folders are also importable by their bare names (the repository
root is on sys.path), so a bare import of gateway/server.py would still run, but as a
second copy of each module (its classes distinct from ``kvmesh.gateway``'s, its
module state split in two) and it would fail once installed, where only ``kvmesh``
exists. Rerunning the relayout codemod rewrites such imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("services", "gateway", "scheduler", "worker", "detokenizer", "kvstore", "kernels",
           "protos", "bench")  # fmt: skip
SCANNED = (*FOLDERS, "kvmesh", "tests", "benchmarks")


def bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return found


def test_no_import_names_a_folder_without_the_namespace() -> None:
    offenders = {
        path.relative_to(REPO).as_posix(): found
        for top in SCANNED
        if (REPO / top).is_dir()
        for path in sorted((REPO / top).rglob("*.py"))
        if (found := bare_imports(path))
    }
    assert offenders == {}


def test_the_check_sees_a_bare_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom kvmesh.protos import common_pb2\nfrom protos import x\n")
    assert bare_imports(probe) == ["3: protos"]
