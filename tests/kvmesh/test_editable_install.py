"""`make install`'s editable install exposes the `kvmesh` package (and keeps the
`kvmesh` command) to code run outside the repository.

The shared test venv may have been installed from another checkout, so the test
makes its own: a throwaway venv that sees this environment's dependencies
through a .pth line, and `pip install --no-deps --no-build-isolation -e` of
this checkout, as `make install` runs it (no network: nothing to download).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    # The dependencies, pip and setuptools (the build backend) from this environment.
    (_site_packages(venv) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "-e", str(REPO)],
        check=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    return venv


def _run(venv: Path, args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_kvmesh_outside_the_repo(venv: Path, tmp_path: Path) -> None:
    out = _run(
        venv,
        [
            str(venv / "bin/python"),
            "-c",
            "import kvmesh; print(kvmesh.__file__); "
            "print(kvmesh.SamplingParams(max_tokens=3).max_tokens); print(kvmesh.LLM.__name__)",
        ],
        cwd=tmp_path,
    )
    file, max_tokens, llm = out.split()
    assert Path(file) == REPO / "kvmesh" / "__init__.py"
    assert (max_tokens, llm) == ("3", "LLM")


def test_the_kvmesh_command_still_runs(venv: Path, tmp_path: Path) -> None:
    out = _run(venv, [str(venv / "bin/kvmesh"), "--help"], cwd=tmp_path)
    assert "up" in out and "serve" in out
