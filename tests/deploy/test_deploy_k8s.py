"""deploy/k8s: schema-valid manifests whose ports, probes and settings match the config
(services/runtime/config/).

The base and each overlay are rendered by kubectl's built-in kustomize (what
``kubectl apply -k`` sends) and every object is checked against the
Kubernetes schemas of the kubernetes-validate package (offline, strict:
unknown fields such as a misspelled ``readinesProbe`` are errors), for the
oldest Kubernetes with GA gRPC probes (1.27) and the newest it knows. The
prometheus-operator's ServiceMonitor has no schema there; its references
(Services, ports) are checked here instead.

Layout: an engine replica is one pod (scheduler + worker + detokenizer) of
the Deployment ``kvmesh-engine``, found by the gateway through the headless
Service ``scheduler-headless``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.services.runtime.config import SERVICE_CONFIGS, GatewayConfig, env_name
from tests.deploy.deploy_facts import (
    DOCUMENTED_EXTRA_ENV,
    K8S_BASE,
    addr_target_service,
    all_config_env_names,
    build_config,
    declared_ports,
)

COMPONENT_LABEL = "app.kubernetes.io/component"
K8S_VERSIONS = ("1.27.0", "1.37.0")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
# Kinds of CRDs, which kubernetes-validate has no schema for.
CUSTOM_KINDS = {"ServiceMonitor"}
HEADLESS_SERVICE = "scheduler-headless"
ENGINE_SERVICES = {"scheduler", "worker", "detokenizer"}
# The adapter's name for vllm:num_requests_waiting (no ':' in the custom metrics API).
WAITING_METRIC = "vllm_num_requests_waiting"

Doc = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Container:
    """One kvmesh container and the Deployment whose pods run it."""

    service: str
    spec: Doc
    deployment: Doc

    @property
    def pod_services(self) -> set[str]:
        """The services of every container in the same pod (reachable on 127.0.0.1)."""
        return {c["name"] for c in self.deployment["spec"]["template"]["spec"]["containers"]}

    @property
    def env(self) -> dict[str, str]:
        return {v["name"]: v["value"] for v in self.spec.get("env", [])}


def _of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in _of_kind(docs, kind)}


def _containers(docs: list[Doc]) -> Iterator[Container]:
    for deployment in _of_kind(docs, "Deployment"):
        for spec in deployment["spec"]["template"]["spec"]["containers"]:
            yield Container(spec["name"], spec, deployment)


def _by_service(docs: list[Doc]) -> dict[str, Container]:
    containers = list(_containers(docs))
    by_service = {c.service: c for c in containers}
    assert len(by_service) == len(containers), "a service runs in two containers"
    return by_service


def _pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selected_deployments(docs: list[Doc], selector: dict[str, str]) -> list[Doc]:
    return [d for d in _of_kind(docs, "Deployment") if selector.items() <= _pod_labels(d).items()]


def _probe_target(probe: Doc) -> tuple[str, int, str | None]:
    """(kind, port, http path or gRPC service) of a probe."""
    for kind, detail in (("grpc", "service"), ("httpGet", "path"), ("tcpSocket", None)):
        if kind in probe:
            return kind, probe[kind]["port"], probe[kind].get(detail) if detail else None
    raise AssertionError(f"probe without a handler: {probe}")


def _config_map(docs: list[Doc]) -> Doc:
    (config_map,) = _of_kind(docs, "ConfigMap")
    return config_map


def _serving_port(service: str) -> int:
    ports = declared_ports(service)
    return ports.http if ports.http is not None else ports.grpc


# ---- files and schemas -----------------------------------------------------


def test_base_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_layout_matches_the_kubernetes_schemas(
    rendered_k8s: dict[str, list[Doc]], version: str
) -> None:
    for layout, docs in rendered_k8s.items():
        for doc in docs:
            if doc["kind"] not in CUSTOM_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)
        assert docs, layout


def test_schema_check_rejects_a_misspelled_probe(k8s_docs: list[Doc]) -> None:
    deployment = copy.deepcopy(_named(k8s_docs, "Deployment")["kvmesh-engine"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_base_defines_the_replicated_layout(k8s_docs: list[Doc]) -> None:
    assert set(_by_service(k8s_docs)) == set(SERVICE_CONFIGS)
    engine = _named(k8s_docs, "Deployment")["kvmesh-engine"]
    assert {c.service for c in _containers([engine])} == ENGINE_SERVICES
    deployments = set(_named(k8s_docs, "Deployment"))
    assert deployments == {"kvmesh-engine", "kvmesh-gateway", "kvmesh-kvstore"}
    headless = _named(k8s_docs, "Service")[HEADLESS_SERVICE]
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert _selected_deployments(k8s_docs, headless["spec"]["selector"]) == [engine]


# ---- containers: ports, probes, resources ----------------------------------


def test_each_container_runs_its_service_on_the_declared_ports(k8s_docs: list[Doc]) -> None:
    for name, container in _by_service(k8s_docs).items():
        assert container.spec["args"] == ["serve", name], name
        assert "command" not in container.spec, f"{name}: keep the image's kvmesh entrypoint"
        ports = {p["containerPort"] for p in container.spec["ports"]}
        assert ports == declared_ports(name).all, name


def test_readiness_probes_use_grpc_health_or_the_gateway_ready_route(
    k8s_docs: list[Doc],
) -> None:
    for name, container in _by_service(k8s_docs).items():
        target = _probe_target(container.spec["readinessProbe"])
        if declared_ports(name).http is not None:
            assert target == ("httpGet", _serving_port(name), "/ready"), name
        else:
            # Readiness is the whole server's status (service ''), not liveness.
            assert target == ("grpc", _serving_port(name), None), name


def test_every_probe_targets_the_port_its_service_serves_on(k8s_docs: list[Doc]) -> None:
    for name, container in _by_service(k8s_docs).items():
        for probe_name in PROBES:
            assert probe_name in container.spec, f"{name} has no {probe_name}"
            kind, port, detail = _probe_target(container.spec[probe_name])
            assert port == _serving_port(name), (name, probe_name, port)
            if kind == "httpGet":
                assert detail in ("/health", "/ready"), (name, probe_name, detail)


def test_liveness_does_not_follow_upstream_services(k8s_docs: list[Doc]) -> None:
    # A service whose readiness follows another service (it dials it) must not
    # be restarted when that one restarts: its liveness is not its readiness.
    for name, container in _by_service(k8s_docs).items():
        config = build_config(name, {})
        dials = [f for f in ("worker_addr", "scheduler_addr") if hasattr(config, f)]
        liveness = container.spec["livenessProbe"]
        if dials:
            assert liveness != container.spec["readinessProbe"], name
            assert _probe_target(liveness)[0] != "grpc", name


def test_worker_liveness_is_its_liveness_health_service(k8s_docs: list[Doc]) -> None:
    from kvmesh.services.runtime.grpc_server import LIVENESS_SERVICE

    liveness = _by_service(k8s_docs)["worker"].spec["livenessProbe"]
    assert _probe_target(liveness) == ("grpc", _serving_port("worker"), LIVENESS_SERVICE)


def test_every_container_requests_cpu_and_memory_and_limits_memory(k8s_docs: list[Doc]) -> None:
    for name, container in _by_service(k8s_docs).items():
        resources = container.spec["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), name
        assert "memory" in resources["limits"], name


def test_replicas_spread_over_nodes(rendered_k8s: dict[str, list[Doc]]) -> None:
    for layout, docs in rendered_k8s.items():
        for name in ("kvmesh-engine", "kvmesh-gateway"):
            deployment = _named(docs, "Deployment")[name]
            constraints = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
            keys = {c["topologyKey"]: c for c in constraints}
            assert "kubernetes.io/hostname" in keys, (layout, name)
            for constraint in constraints:
                selector = constraint["labelSelector"]["matchLabels"]
                assert _selected_deployments(docs, selector) == [deployment], (layout, name)
        engine = _named(docs, "Deployment")["kvmesh-engine"]
        hostname = {
            c["topologyKey"]: c["whenUnsatisfiable"]
            for c in engine["spec"]["template"]["spec"]["topologySpreadConstraints"]
        }["kubernetes.io/hostname"]
        assert hostname == ("DoNotSchedule" if layout == "fleet" else "ScheduleAnyway"), layout


# ---- services and addresses ------------------------------------------------


def test_services_select_pods_and_expose_their_container_ports(k8s_docs: list[Doc]) -> None:
    for name, service in _named(k8s_docs, "Service").items():
        (deployment,) = _selected_deployments(k8s_docs, service["spec"]["selector"])
        assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        container_ports = {
            p["name"]: p["containerPort"]
            for c in _containers([deployment])
            for p in c.spec["ports"]
        }
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            resolved = container_ports[target] if isinstance(target, str) else target
            assert resolved == port["port"], (name, port)


def test_addresses_reach_the_target_service_and_port(k8s_docs: list[Doc]) -> None:
    services = _named(k8s_docs, "Service")
    shared = _config_map(k8s_docs)["data"]
    dialled = set()
    for container in _containers(k8s_docs):
        for var, value in (shared | container.env).items():
            target = addr_target_service(var)
            if target is None or not hasattr(build_config(container.service, {}), var[7:].lower()):
                continue
            dialled.add(target)
            host, _, port = value.rpartition(":")
            assert int(port) == declared_ports(target).grpc, (container.service, var, value)
            if host == "127.0.0.1":
                assert target in container.pod_services, (container.service, var)
                continue
            assert host in services, (container.service, var, f"no Service {host}")
            (deployment,) = _selected_deployments(k8s_docs, services[host]["spec"]["selector"])
            assert target in {c.service for c in _containers([deployment])}, (var, value)
    assert dialled == {"worker", "scheduler", "detokenizer", "kvstore"}


def test_gateway_finds_the_replicas_through_the_headless_service(k8s_docs: list[Doc]) -> None:
    env = _by_service(k8s_docs)["gateway"].env
    for var in ("KVMESH_SCHEDULER_ADDR", "KVMESH_DETOKENIZER_ADDR"):
        assert env[var].rpartition(":")[0] == HEADLESS_SERVICE, var
    if any(f.name == "replica_discovery" for f in dataclasses.fields(GatewayConfig)):
        # Once the gateway discovers replicas, it must do so by DNS here.
        assert env.get(env_name("replica_discovery")) == "dns"


def test_config_sets_only_real_options_and_every_container_reads_it(k8s_docs: list[Doc]) -> None:
    config_map = _config_map(k8s_docs)
    known = all_config_env_names() | DOCUMENTED_EXTRA_ENV
    assert set(config_map["data"]) <= known
    for container in _containers(k8s_docs):
        sources = container.spec.get("envFrom", [])
        names = [s["configMapRef"]["name"] for s in sources if "configMapRef" in s]
        assert config_map["metadata"]["name"] in names, container.service
        kvmesh_vars = {v for v in container.env if v.startswith("KVMESH_")}
        assert kvmesh_vars <= known, container.service


def test_config_builds_a_valid_config_for_every_container(k8s_docs: list[Doc]) -> None:
    shared = {k: str(v) for k, v in _config_map(k8s_docs)["data"].items()}
    for name, container in _by_service(k8s_docs).items():
        # Construction runs the dataclasses' validation on every value set.
        config = build_config(name, shared | container.env)
        assert config.bind_host == "0.0.0.0", name


# ---- metrics: scraping and autoscaling -------------------------------------


def _scraped_ports(docs: list[Doc]) -> set[tuple[str, int]]:
    """(deployment, container port) pairs that Prometheus scrapes, by either mechanism."""
    scraped = set()
    for deployment in _of_kind(docs, "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert annotations["prometheus.io/path"] == "/metrics"
            scraped.add((deployment["metadata"]["name"], int(annotations["prometheus.io/port"])))
    services = list(_of_kind(docs, "Service"))
    for monitor in _of_kind(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        (deployment,) = _selected_deployments(docs, service["spec"]["selector"])
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            scraped.add((deployment["metadata"]["name"], ports[endpoint["port"]]))
    return scraped


def test_each_pod_has_a_scrape_annotation_on_a_metrics_port(k8s_docs: list[Doc]) -> None:
    for name, container in _by_service(k8s_docs).items():
        if container.service in ("worker", "detokenizer"):
            continue  # the engine pod's one annotation names the scheduler's port
        deployment = container.deployment["metadata"]["name"]
        assert (deployment, declared_ports(name).metrics) in _scraped_ports(k8s_docs), name


def test_fleet_scrapes_every_metrics_port(rendered_k8s: dict[str, list[Doc]]) -> None:
    docs = rendered_k8s["fleet"]
    scraped = _scraped_ports(docs)
    for name, container in _by_service(docs).items():
        deployment = container.deployment["metadata"]["name"]
        assert (deployment, declared_ports(name).metrics) in scraped, name


def test_fleet_autoscales_gateway_and_engine_which_set_no_replica_count(
    rendered_k8s: dict[str, list[Doc]],
) -> None:
    docs = rendered_k8s["fleet"]
    deployments = _named(docs, "Deployment")
    scaled = {}
    for hpa in _of_kind(docs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment"
        scaled[target["name"]] = hpa["spec"]
        assert "replicas" not in deployments[target["name"]]["spec"], target["name"]
        assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert set(scaled) == {"kvmesh-gateway", "kvmesh-engine"}
    kinds = {m["type"] for m in scaled["kvmesh-gateway"]["metrics"]}
    assert kinds == {"Resource"}
    engine_metrics = {m["type"]: m for m in scaled["kvmesh-engine"]["metrics"]}
    assert set(engine_metrics) == {"Pods", "ContainerResource"}
    container = engine_metrics["ContainerResource"]["containerResource"]["container"]
    assert container in ENGINE_SERVICES
    assert engine_metrics["Pods"]["pods"]["metric"]["name"] == WAITING_METRIC


def test_waiting_metric_is_the_schedulers_gauge() -> None:
    from prometheus_client import CollectorRegistry

    metrics = SchedulerMetrics("m", registry=CollectorRegistry())
    assert metrics.num_waiting._name.replace(":", "_") == WAITING_METRIC


def test_fleet_disruption_budgets_cover_the_replicated_deployments(
    rendered_k8s: dict[str, list[Doc]],
) -> None:
    docs = rendered_k8s["fleet"]
    covered = set()
    for budget in _of_kind(docs, "PodDisruptionBudget"):
        (deployment,) = _selected_deployments(docs, budget["spec"]["selector"]["matchLabels"])
        covered.add(deployment["metadata"]["name"])
        assert budget["spec"].get("maxUnavailable", 1) == 1
    assert covered == {"kvmesh-gateway", "kvmesh-engine"}


def test_one_node_neither_autoscales_nor_budgets_and_recreates_the_engine(
    rendered_k8s: dict[str, list[Doc]],
) -> None:
    docs = rendered_k8s["one-node"]
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"}
    engine = _named(docs, "Deployment")["kvmesh-engine"]
    assert engine["spec"]["strategy"] == {"type": "Recreate"}
    assert engine["spec"]["replicas"] == 1
