"""Fixtures for the deployment-file tests: each file parsed once per session."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.deploy_facts import load_compose, load_k8s_docs


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="session")
def k8s_docs() -> list[dict[str, Any]]:
    return load_k8s_docs()
