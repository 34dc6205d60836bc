"""The wheel installs one top-level package, ``kvmesh``: no generic names in site-packages.

``kernels``, ``services`` or ``protos`` at the top of site-packages would collide with
other distributions of that name (the Hugging Face kernel hub's ``kernels`` is one
transformers imports). pyproject's package-dir installs every folder under
``kvmesh/``; this test builds the wheel's install from the checkout and checks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The folders pyproject's package-dir maps under the namespace.
FOLDERS = ("services", "gateway", "scheduler", "worker", "detokenizer", "kvstore", "kernels",
           "protos")  # fmt: skip


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    # Built from a copy of the checkout's files: pip builds in the source tree, and a
    # stale build/ there (an older layout) would ship in the wheel.
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, source / rel)
    target = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, timeout=600, env=env, cwd=source,
    )  # fmt: skip
    return target


def test_only_kvmesh_at_the_top(target: Path) -> None:
    top = {p.name for p in target.iterdir() if p.name != "bin"}
    assert {name for name in top if not name.endswith(".dist-info")} == {"kvmesh"}


def test_every_package_folder_is_installed(target: Path) -> None:
    """pyproject lists the packages one by one: a new folder missing from it fails here."""
    missing = [
        init.parent.relative_to(REPO).as_posix()
        for folder in FOLDERS
        for init in sorted((REPO / folder).rglob("__init__.py"))
        if not (target / "kvmesh" / init.relative_to(REPO)).is_file()
    ]
    assert missing == []
    assert list((target / "kvmesh" / "kernels" / "csrc").glob("*.cpp"))


def test_the_installed_namespace_imports_outside_the_repo(target: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c",
         "import kvmesh.gateway.server, kvmesh.protos.generation_pb2_grpc, kvmesh.services; "
         "import sys; print(kvmesh.gateway.__file__); "
         "print(sorted({m.split('.')[0] for m in sys.modules} & {'gateway', 'protos'}))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    file, generic = done.stdout.splitlines()
    assert Path(file) == target / "kvmesh" / "gateway" / "__init__.py"
    assert generic == "[]"
