"""Fixtures for the deployment-file tests: each file parsed once per session."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.deploy.deploy_facts import (
    K8S_BASE,
    K8S_DIR,
    K8S_OVERLAYS,
    load_compose,
    load_k8s_docs,
    render_kustomization,
)


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="session")
def k8s_docs() -> list[dict[str, Any]]:
    return load_k8s_docs()


@pytest.fixture(scope="session")
def rendered_k8s() -> dict[str, list[dict[str, Any]]]:
    """The base and each overlay as kustomize renders them, by name."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (kustomize built in) is not installed: overlays cannot be rendered")
    folders = {"base": K8S_BASE} | {name: K8S_DIR / "overlays" / name for name in K8S_OVERLAYS}
    return {name: render_kustomization(folder) for name, folder in folders.items()}
