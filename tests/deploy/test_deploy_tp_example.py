"""deploy/k8s/worker-tp-statefulset.yaml.example: schema-valid; its settings are real options."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from kvmesh.services.runtime.config import WorkerConfig
from tests.deploy.deploy_facts import K8S_DIR, build_config

EXAMPLE = K8S_DIR / "worker-tp-statefulset.yaml.example"
# Pod-index labels (the rank) exist from 1.28; the newest schema kubernetes-validate knows.
K8S_VERSIONS = ("1.28.0", "1.37.0")


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d is not None]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_example_matches_the_kubernetes_schemas(docs: list[dict], version: str) -> None:
    assert [d["kind"] for d in docs] == ["StatefulSet", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_example_runs_as_many_pods_as_ranks_with_a_valid_worker_config(docs: list[dict]) -> None:
    statefulset, service = docs
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "0") for e in container["env"]}  # rank: pod 0's
    config: WorkerConfig = build_config("worker", env)
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    assert statefulset["spec"]["replicas"] == ranks > 1
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    # Every rank dials pod 0 of the headless service by its stable name.
    assert service["spec"]["clusterIP"] == "None"
    name = statefulset["metadata"]["name"]
    host, port = config.dist_init_addr.rsplit(":", 1)
    assert host == f"{name}-0.{statefulset['spec']['serviceName']}"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert {p["port"] for p in service["spec"]["ports"]} >= {config.worker_port}
