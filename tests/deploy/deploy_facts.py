"""Facts for the deployment-file tests: the files, and what services/runtime/config/ declares.

Every expectation is derived from the config dataclasses, never restated, so
a port or option renamed there makes these tests point at the stale file.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvmesh.services.runtime.config import (
    PROCESS_SETTINGS,
    SERVICE_CONFIGS,
    config_from_namespace,
    env_name,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
K8S_BASE = K8S_DIR / "base"
K8S_OVERLAYS = ("one-node", "fleet")

# Variables that are not config fields but that every process of the stack
# reads (where the caches live, kernel switches): a container may set them.
DOCUMENTED_EXTRA_ENV = frozenset(s.name for s in PROCESS_SETTINGS)


@dataclasses.dataclass(frozen=True)
class ServicePorts:
    """One service's ports by role, as services/runtime/config/ declares them by default."""

    name: str
    grpc: int
    metrics: int
    http: int | None = None

    @property
    def all(self) -> set[int]:
        return {p for p in (self.grpc, self.metrics, self.http) if p is not None}


def config_defaults(service: str) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(SERVICE_CONFIGS[service])}


def declared_ports(service: str) -> ServicePorts:
    defaults = config_defaults(service)
    if service == "gateway":
        # The gateway serves /metrics on its HTTP port.
        http = defaults["http_port"]
        return ServicePorts(service, grpc=defaults["grpc_port"], metrics=http, http=http)
    return ServicePorts(
        service, grpc=defaults[f"{service}_port"], metrics=defaults[f"{service}_metrics_port"]
    )


def env_names_read_by(service: str) -> set[str]:
    return {env_name(f.name) for f in dataclasses.fields(SERVICE_CONFIGS[service])}


def all_config_env_names() -> set[str]:
    return set().union(*(env_names_read_by(s) for s in SERVICE_CONFIGS))


def addr_target_service(var: str) -> str | None:
    """KVMESH_WORKER_ADDR -> "worker": the service an address variable points at."""
    match = re.fullmatch(r"KVMESH_([A-Z]+)_ADDR", var)
    if match is None or match.group(1).lower() not in SERVICE_CONFIGS:
        return None
    return match.group(1).lower()


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def load_k8s_docs() -> list[dict[str, Any]]:
    """The base's manifests as written (its kustomization file included)."""
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S_BASE.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


def render_kustomization(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl apply -k folder`` would send, rendered by kubectl's own kustomize."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise FileNotFoundError("kubectl (with its built-in kustomize) is not on PATH")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(rendered) if d is not None]


# What the README has users export before `docker compose up`: the file
# requires it (``${VAR:?...}``), so the tests interpolate it as set.
COMPOSE_USER_ENV = {"KVMESH_INTERNAL_AUTH_TOKEN": "0123456789abcdef" * 4}
_COMPOSE_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}")


class MissingComposeVariable(ValueError):
    """A ``${VAR:?error}`` / ``${VAR?error}`` without its variable: compose refuses to start."""


def interpolate_defaults(value: str, environ: Mapping[str, str] = COMPOSE_USER_ENV) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}`` and
    ``${VAR?error}`` under ``environ`` (by default: only what the README has users export)."""

    def substitute(match: re.Match[str]) -> str:
        name, colon, kind, text = match.groups()
        current = environ.get(name)
        if current is not None and not (colon and current == ""):
            return current
        if kind == "?":
            raise MissingComposeVariable(f"{name}: {text}")
        return text if kind == "-" else ""

    return _COMPOSE_VARIABLE.sub(substitute, value)


def build_config(service: str, environ: dict[str, str]) -> Any:
    """The config ``kvmesh serve SERVICE`` would build from ``environ`` (no flags)."""
    return config_from_namespace(SERVICE_CONFIGS[service], argparse.Namespace(), environ)
