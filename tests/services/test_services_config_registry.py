"""The config registry is the only place that declares and reads settings.

The scans below fail when code (or a deployment file) names a ``KVMESH_*``
variable the registry does not declare, reads the environment outside
``services/runtime/config/``, or compares against a scheduling-policy name instead of
using the registry's declaration. Each scanner is first shown a violation,
so that a scan that finds nothing means something.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Collection
from pathlib import Path

import pytest

from kvmesh.kernels.registry import BACKENDS
from kvmesh.scheduler.policy import POLICY_CLASSES, make_policy
from kvmesh.services.cli.launcher import READY_MARKER
from kvmesh.services.runtime.config import (
    ATTENTION_BACKENDS,
    SCHEDULING_POLICIES,
    declared_env_names,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
REGISTRY = REPO_ROOT / "services" / "runtime" / "config"
PACKAGES = (
    "services",
    "gateway",
    "scheduler",
    "worker",
    "detokenizer",
    "kvstore",
    "kernels",
    "bench",
    "benchmarks",
)
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build"}
TEXT_SUFFIXES = {".py", ".sh", ".yml", ".yaml", ".toml", ".md"}
TEXT_NAMES = {"Dockerfile", "Makefile", ".dockerignore"}
ENV_VAR_NAME = re.compile(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b")
ENV_READERS = {"environ", "environb", "getenv", "getenvb"}


def _outside_registry(paths: list[Path]) -> list[Path]:
    return [p for p in paths if REGISTRY not in p.parents]


def _repo_text_files() -> list[Path]:
    files = [
        p
        for p in REPO_ROOT.rglob("*")
        if p.is_file()
        and not SKIPPED_DIRS.intersection(p.relative_to(REPO_ROOT).parts)
        and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES)
    ]
    return _outside_registry(files)


def _package_sources() -> list[Path]:
    return _outside_registry(
        [p for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py")]
    )


def undeclared_kvmesh_names(text: str) -> set[str]:
    return set(ENV_VAR_NAME.findall(text)) - declared_env_names() - {READY_MARKER}


def _reads_environment(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return (
            node.attr in ENV_READERS and isinstance(node.value, ast.Name) and node.value.id == "os"
        )
    if isinstance(node, ast.ImportFrom):
        return node.module == "os" and any(alias.name in ENV_READERS for alias in node.names)
    return False


def env_reads(source: str) -> list[int]:
    """Lines that touch ``os.environ``/``os.getenv`` or import them from ``os``."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if _reads_environment(node))


def _string_constants(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for element in node.elts for s in _string_constants(element)]
    return []


def _mentions_policy(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "policy" in name.lower()


def policy_literal_checks(source: str) -> list[int]:
    """Lines that compare with a policy name by literal, or a policy with any literal."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [s for operand in operands for s in _string_constants(operand)]
            if set(literals) & set(SCHEDULING_POLICIES) or (
                literals and any(_mentions_policy(operand) for operand in operands)
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and set(_string_constants(node.value)) & set(
            SCHEDULING_POLICIES
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_scanners_catch_violations() -> None:
    undeclared = "KVMESH_" + "SURELY_UNDECLARED"
    assert undeclared_kvmesh_names(f"x = environ['{undeclared}']") == {undeclared}
    assert undeclared_kvmesh_names("KVMESH_MODEL_CACHE=/m KVMESH_WORKER_PORT=1") == set()
    reads = "import os\na = os.environ.get('X')\nb = os.getenv('Y')\nfrom os import environ\n"
    assert env_reads(reads) == [2, 3, 4]
    policy = SCHEDULING_POLICIES[0]
    checks = (
        f"if name == '{policy}': pass\n"
        "if config.scheduling_policy != 'lifo': pass\n"
        f"if p in ('{policy}', 'x'): pass\n"
        f"match p:\n    case '{policy}': pass\n"
        "if status == 'running': pass\n"
    )
    assert policy_literal_checks(checks) == [1, 2, 3, 5]


def _findings(paths: list[Path], scan: Callable[[str], Collection[object]]) -> dict[str, object]:
    """Relative path -> what ``scan`` found in it, for every path where it found something."""
    found = {str(p.relative_to(REPO_ROOT)): scan(p.read_text(errors="replace")) for p in paths}
    return {path: hits for path, hits in found.items() if hits}


def test_every_kvmesh_name_anywhere_is_declared_in_the_registry() -> None:
    files = _repo_text_files()
    assert REPO_ROOT / "docker-compose.yml" in files and REPO_ROOT / "Dockerfile" in files
    assert _findings(files, undeclared_kvmesh_names) == {}, (
        "declare these in services/runtime/config (options or process settings)"
    )


def test_environment_is_read_only_by_the_registry() -> None:
    assert _findings(_package_sources(), env_reads) == {}, (
        "read it through kvmesh.services.runtime.config (an option or an EnvSetting)"
    )


def test_policy_names_are_checked_only_through_the_registry() -> None:
    assert _findings(_package_sources(), policy_literal_checks) == {}, (
        "use kvmesh.services.runtime.config.SCHEDULING_POLICIES / SchedulingPolicyName"
    )


def test_every_declared_policy_has_exactly_one_class() -> None:
    assert sorted(POLICY_CLASSES) == sorted(SCHEDULING_POLICIES)
    for name in SCHEDULING_POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="one of " + ", ".join(SCHEDULING_POLICIES)):
        make_policy("lifo")


def test_declared_attention_backends_are_the_registered_ones() -> None:
    assert sorted(BACKENDS) == sorted(ATTENTION_BACKENDS)
