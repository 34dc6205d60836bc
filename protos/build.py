"""Generate the Python modules for protos/*.proto (grpcio-tools' bundled protoc).

Run from anywhere: ``python -m kvmesh.protos.build``. The generated ``*_pb2.py``,
``*_pb2.pyi`` and ``*_pb2_grpc.py`` files are committed and never edited by
hand; tests/test_protos_generated.py fails when they drift from the sources.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = REPO_ROOT) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    sources = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "protos").glob("*.proto"))
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    _namespace_imports(out_dir)


def _namespace_imports(out_dir: Path) -> None:
    """protoc names each module after the .proto's folder (``from kvmesh.protos import``); the
    package installs under the kvmesh namespace, so the generated code says that."""
    for path in sorted((out_dir / "protos").glob("*_pb2*.py*")):
        text = path.read_text()
        fixed = re.sub(r"^from (protos) import", r"from kvmesh.\1 import", text, flags=re.M)
        fixed = re.sub(r"(DESCRIPTOR, ')(protos)\.", r"\1kvmesh.\2.", fixed)
        if fixed != text:
            path.write_text(fixed)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
