"""deploy/k8s: schema-valid manifests whose ports, probes and settings match services/config/.

Schemas come from the kubernetes-validate package (offline, strict: unknown
fields such as a misspelled ``readinesProbe`` are errors), checked against the
oldest Kubernetes with GA gRPC probes (1.27) and the newest it knows.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.config import SERVICE_CONFIGS
from tests.deploy.deploy_facts import (
    DOCUMENTED_EXTRA_ENV,
    K8S_DIR,
    addr_target_service,
    all_config_env_names,
    build_config,
    declared_ports,
)

COMPONENT_LABEL = "app.kubernetes.io/component"
K8S_VERSIONS = ("1.27.0", "1.37.0")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")

Doc = dict[str, Any]


def _of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    """Objects of one kind by the service they belong to (their component label)."""
    found = [d for d in docs if d["kind"] == kind]
    by_service = {d["metadata"]["labels"][COMPONENT_LABEL]: d for d in found}
    assert len(by_service) == len(found), f"two {kind}s for one component"
    return by_service


def _container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _probe_target(probe: Doc) -> tuple[str, int, str | None]:
    """(kind, port, http path) of a probe."""
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            return kind, probe[kind]["port"], probe[kind].get("path")
    raise AssertionError(f"probe without a handler: {probe}")


def _config_map(docs: list[Doc]) -> Doc:
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == 1
    return maps[0]


def test_one_deployment_and_one_service_per_kvmesh_service(k8s_docs: list[Doc]) -> None:
    assert set(_of_kind(k8s_docs, "Deployment")) == set(SERVICE_CONFIGS)
    assert set(_of_kind(k8s_docs, "Service")) == set(SERVICE_CONFIGS)
    kinds = {"Deployment", "Service", "ConfigMap", "Kustomization", "NetworkPolicy", "Secret"}
    assert {d["kind"] for d in k8s_docs} == kinds


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    # Examples hold placeholders and are applied by hand, never by kustomize.
    examples = {p.name for p in K8S_DIR.glob("*.example.yaml")}
    manifests = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml", *examples}
    assert set(kustomization["resources"]) == manifests


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(k8s_docs: list[Doc], version: str) -> None:
    for doc in k8s_docs:
        if doc["kind"] == "Kustomization":
            continue  # a kustomize file, not an API object
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_check_rejects_a_misspelled_probe(k8s_docs: list[Doc]) -> None:
    deployment = copy.deepcopy(_of_kind(k8s_docs, "Deployment")["worker"])
    container = _container(deployment)
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_each_deployment_runs_its_service_on_the_declared_ports(k8s_docs: list[Doc]) -> None:
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        container = _container(deployment)
        assert container["args"] == ["serve", name], name
        assert "command" not in container, f"{name}: keep the image's kvmesh entrypoint"
        ports = {p["containerPort"] for p in container["ports"]}
        assert ports == declared_ports(name).all, name


def test_readiness_probes_use_grpc_health_or_the_gateway_ready_route(
    k8s_docs: list[Doc],
) -> None:
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        readiness = _container(deployment)["readinessProbe"]
        ports = declared_ports(name)
        if ports.http is not None:
            assert _probe_target(readiness) == ("httpGet", ports.http, "/ready"), name
        else:
            assert _probe_target(readiness) == ("grpc", ports.grpc, None), name


def test_every_probe_targets_a_port_the_service_listens_on(k8s_docs: list[Doc]) -> None:
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        container = _container(deployment)
        ports = declared_ports(name)
        serving_ports = {ports.http} if ports.http is not None else {ports.grpc}
        for probe_name in PROBES:
            assert probe_name in container, f"{name} has no {probe_name}"
            kind, port, path = _probe_target(container[probe_name])
            assert port in serving_ports, (name, probe_name, port)
            if kind == "httpGet":
                assert path in ("/health", "/ready"), (name, probe_name, path)


def test_liveness_does_not_follow_upstream_services(k8s_docs: list[Doc]) -> None:
    # A service whose readiness follows another service (it dials it) must not
    # be restarted when that one restarts: its liveness is not its readiness.
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        dials = [
            f
            for f in ("worker_addr", "scheduler_addr", "detokenizer_addr")
            if hasattr(build_config(name, {}), f)
        ]
        container = _container(deployment)
        if dials:
            assert container["livenessProbe"] != container["readinessProbe"], name
            assert "grpc" not in container["livenessProbe"], name


def test_prometheus_scrapes_each_metrics_port(k8s_docs: list[Doc]) -> None:
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert int(annotations["prometheus.io/port"]) == declared_ports(name).metrics, name
        assert annotations["prometheus.io/path"] == "/metrics", name


def test_every_container_requests_cpu_and_memory(k8s_docs: list[Doc]) -> None:
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        requests = _container(deployment)["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), name


def test_services_select_their_pods_and_expose_the_declared_ports(k8s_docs: list[Doc]) -> None:
    deployments = _of_kind(k8s_docs, "Deployment")
    for name, service in _of_kind(k8s_docs, "Service").items():
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        selector = service["spec"]["selector"]
        assert selector.items() <= pod_labels.items(), name
        assert deployments[name]["spec"]["selector"]["matchLabels"] == selector, name
        container_ports = {
            p["name"]: p["containerPort"] for p in _container(deployments[name])["ports"]
        }
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            resolved = container_ports[target] if isinstance(target, str) else target
            assert resolved == port["port"], (name, port)
        assert {p["port"] for p in service["spec"]["ports"]} == declared_ports(name).all, name


def test_config_map_sets_only_real_options_and_every_pod_reads_it(k8s_docs: list[Doc]) -> None:
    config_map = _config_map(k8s_docs)
    known = all_config_env_names() | DOCUMENTED_EXTRA_ENV
    for var in config_map["data"]:
        assert var in known, f"{var} is no KVMESH_ option"
    for name, deployment in _of_kind(k8s_docs, "Deployment").items():
        sources = _container(deployment).get("envFrom", [])
        names = [s["configMapRef"]["name"] for s in sources if "configMapRef" in s]
        assert config_map["metadata"]["name"] in names, name
        for var in _container(deployment).get("env", []):
            assert not var["name"].startswith("KVMESH_") or var["name"] in known, name


def test_addresses_point_at_the_target_service_and_port(k8s_docs: list[Doc]) -> None:
    services = {s["metadata"]["name"]: c for c, s in _of_kind(k8s_docs, "Service").items()}
    data = _config_map(k8s_docs)["data"]
    addresses = {var: value for var, value in data.items() if addr_target_service(var)}
    assert {addr_target_service(v) for v in addresses} == {"worker", "scheduler", "detokenizer"}
    for var, value in addresses.items():
        host, _, port = value.rpartition(":")
        target = addr_target_service(var)
        assert services.get(host) == target, f"{var}={value}: no Service for {target} named {host}"
        assert int(port) == declared_ports(target).grpc, f"{var}={value}"


def test_config_map_builds_a_valid_config_for_every_service(k8s_docs: list[Doc]) -> None:
    data = {k: str(v) for k, v in _config_map(k8s_docs)["data"].items()}
    for name in SERVICE_CONFIGS:
        # Construction runs the dataclasses' validation on every value set.
        assert build_config(name, data).bind_host == "0.0.0.0", name
