"""deploy/k8s security: the Secrets every container reads; NetworkPolicies following the calls.

The call graph is derived from services/runtime/config/: a service dials another when
its config has that one's ``<name>_addr`` option. It is mapped onto pods
through the Deployments' containers (an engine pod runs the scheduler, the
worker and the detokenizer): a call between two containers of one pod goes
over the pod's loopback, which no NetworkPolicy filters, so only calls between
pods need a rule, and the rule admits the calling pods.

Every check runs on the base's files as written and on each overlay as
kubectl's kustomize renders it (skipped where kubectl is not installed).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.services.cli.k8s_secret import AUTH_SECRET, TLS_SECRET, TOKEN_KEY, render, stack_secrets
from kvmesh.services.runtime.config import SERVICE_CONFIGS, env_name
from tests.deploy.deploy_facts import (
    K8S_BASE,
    K8S_DIR,
    K8S_OVERLAYS,
    build_config,
    declared_ports,
)

Doc = dict[str, Any]
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
K8S_VERSION = "1.37.0"
SECRET_EXAMPLE = "secret.example.yaml"
# Where the Deployments mount Secret kvmesh-internal-tls.
TLS_MOUNT_PATH = PurePosixPath("/etc/kvmesh/internal-tls")
# The configmap's commented-out settings that turn mutual TLS on, by option,
# and the key of the Secret (a kubernetes.io/tls one, plus the CA) each names.
TLS_FILE_KEYS = {
    "internal_tls_certfile": "tls.crt",
    "internal_tls_keyfile": "tls.key",
    "internal_tls_ca_certs": "ca.crt",
}


@pytest.fixture(params=("base", *K8S_OVERLAYS))
def layout(request: pytest.FixtureRequest, k8s_docs: list[Doc]) -> list[Doc]:
    """The base's files, or an overlay rendered by kustomize."""
    if request.param == "base":
        return k8s_docs
    return request.getfixturevalue("rendered_k8s")[request.param]


def _deployments(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] == "Deployment"]


def _containers(deployment: Doc) -> list[Doc]:
    return deployment["spec"]["template"]["spec"]["containers"]


def _pod_component(deployment: Doc) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"][COMPONENT]


def _selected_pods(docs: list[Doc], selector: Doc) -> set[str]:
    """The components of the pods a label selector matches."""
    return {
        _pod_component(d)
        for d in _deployments(docs)
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    }


def _pods(docs: list[Doc]) -> dict[str, set[str]]:
    """Pod (its component label) -> the services its containers run."""
    return {_pod_component(d): {c["name"] for c in _containers(d)} for d in _deployments(docs)}


def _pod_of(docs: list[Doc]) -> dict[str, str]:
    """Service -> the pod that runs it (each runs in exactly one)."""
    pod_of = {service: pod for pod, services in _pods(docs).items() for service in services}
    assert set(pod_of) == set(SERVICE_CONFIGS)
    assert sum(len(s) for s in _pods(docs).values()) == len(pod_of), "a service in two pods"
    return pod_of


def _callers(target: str) -> set[str]:
    """The services whose config dials ``target``."""
    return {name for name in SERVICE_CONFIGS if hasattr(build_config(name, {}), f"{target}_addr")}


def _dialing_pods(docs: list[Doc]) -> dict[str, dict[int, set[str]]]:
    """Pod -> each gRPC port other pods dial -> those pods (calls inside a pod left out)."""
    pod_of = _pod_of(docs)
    dialed: dict[str, dict[int, set[str]]] = {pod: {} for pod in _pods(docs)}
    for target, pod in pod_of.items():
        callers = {pod_of[caller] for caller in _callers(target)} - {pod}
        if callers:
            dialed[pod][declared_ports(target).grpc] = callers
    return dialed


def _policies(docs: list[Doc]) -> dict[str | None, Doc]:
    """NetworkPolicies by the component they select (None: every kvmesh pod)."""
    found = [d for d in docs if d["kind"] == "NetworkPolicy"]
    policies = {d["spec"]["podSelector"]["matchLabels"].get(COMPONENT): d for d in found}
    assert len(policies) == len(found), "two policies select the same pods"
    return policies


def _rules_by_port(policy: Doc) -> dict[int, list[Doc] | None]:
    """Ingress port -> its ``from`` peers (None: from anywhere)."""
    rules: dict[int, list[Doc] | None] = {}
    for rule in policy["spec"].get("ingress", []):
        for port in rule["ports"]:
            assert port["port"] not in rules, f"port {port['port']} in two rules"
            rules[port["port"]] = rule.get("from")
    return rules


def _peer_pods(docs: list[Doc], peers: list[Doc] | None) -> set[str]:
    """The kvmesh pods a rule's ``from`` admits: pod selectors in the policy's namespace only."""
    assert peers, "open to anywhere"
    admitted = set()
    for peer in peers:
        assert set(peer) == {"podSelector"}, peer  # no namespaceSelector, no ipBlock
        selector = peer["podSelector"]["matchLabels"]
        assert selector[NAME] == "kvmesh", peer
        admitted |= _selected_pods(docs, selector)
    return admitted


def _config_map(docs: list[Doc]) -> Doc:
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return config_map


def _example_secrets() -> list[Doc]:
    return list(yaml.safe_load_all((K8S_DIR / SECRET_EXAMPLE).read_text()))


def _commented_tls_settings() -> dict[str, str]:
    """The configmap's commented-out ``KVMESH_INTERNAL_TLS_*`` lines: uncommented, TLS is on."""
    text = (K8S_BASE / "configmap.yaml").read_text()
    return dict(re.findall(r'^\s*#\s*(KVMESH_INTERNAL_TLS_\w+):\s*"([^"]*)"', text, re.MULTILINE))


# ---- NetworkPolicies --------------------------------------------------------


def test_ingress_is_denied_to_every_kvmesh_pod_but_what_a_policy_allows(
    layout: list[Doc],
) -> None:
    deny = _policies(layout)[None]
    assert deny["spec"]["podSelector"]["matchLabels"] == {NAME: "kvmesh"}
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    assert _selected_pods(layout, deny["spec"]["podSelector"]["matchLabels"]) == set(_pods(layout))


def test_each_pod_has_one_policy_selecting_it(layout: list[Doc]) -> None:
    policies = _policies(layout)
    assert set(policies) == {None, *_pods(layout)}
    for component, policy in policies.items():
        if component is not None:
            selected = _selected_pods(layout, policy["spec"]["podSelector"]["matchLabels"])
            assert selected == {component}, component
            assert policy["spec"]["policyTypes"] == ["Ingress"], component


def test_each_internal_port_admits_exactly_the_pods_that_dial_it(layout: list[Doc]) -> None:
    policies = _policies(layout)
    gateway_pod = _pod_of(layout)["gateway"]
    for pod, dialed in _dialing_pods(layout).items():
        if pod == gateway_pod:
            continue  # public: the next test
        assert dialed, f"{pod}: no other pod dials it, yet it has a policy"
        services = _pods(layout)[pod]
        metrics = {declared_ports(s).metrics for s in services}
        rules = _rules_by_port(policies[pod])
        # A port dialed only from inside the pod (the worker's) admits no pod.
        assert set(rules) == set(dialed) | metrics, pod
        for port, callers in dialed.items():
            assert _peer_pods(layout, rules[port]) == callers, (pod, port)
        for port in metrics:
            assert rules[port] == [{"namespaceSelector": {"matchLabels": MONITORING}}], (pod, port)


def test_engine_pod_admits_the_gateway_on_its_scheduler_and_detokenizer_ports(
    layout: list[Doc],
) -> None:
    # The graph above, spelled out for the layout of deploy/k8s/README.md.
    pod_of = _pod_of(layout)
    engine, gateway = pod_of["scheduler"], pod_of["gateway"]
    assert pod_of["worker"] == pod_of["detokenizer"] == engine
    rules = _rules_by_port(_policies(layout)[engine])
    for service in ("scheduler", "detokenizer"):
        assert _peer_pods(layout, rules[declared_ports(service).grpc]) == {gateway}, service
    assert declared_ports("worker").grpc not in rules
    kvstore_rules = _rules_by_port(_policies(layout)[pod_of["kvstore"]])
    assert _peer_pods(layout, kvstore_rules[declared_ports("kvstore").grpc]) == {engine}


def test_only_the_gateway_public_ports_are_open_to_all(layout: list[Doc]) -> None:
    ports = declared_ports("gateway")
    gateway_pod = _pod_of(layout)["gateway"]
    assert _pods(layout)[gateway_pod] == {"gateway"}
    rules = _rules_by_port(_policies(layout)[gateway_pod])
    assert rules == {ports.http: None, ports.grpc: None}
    for pod, policy in _policies(layout).items():
        open_ports = [p for p, peers in _rules_by_port(policy).items() if peers is None]
        assert pod == gateway_pod or not open_ports, (pod, open_ports)


def test_calls_inside_a_pod_stay_on_its_loopback(layout: list[Doc]) -> None:
    # Why an in-pod call needs no rule: it never leaves the pod's loopback.
    shared = {k: str(v) for k, v in _config_map(layout)["data"].items()}
    in_pod_calls = set()
    for deployment in _deployments(layout):
        services = {c["name"] for c in _containers(deployment)}
        for container in _containers(deployment):
            env = {v["name"]: v["value"] for v in container.get("env", [])}
            config = build_config(container["name"], shared | env)
            for target in (s for s in services if hasattr(config, f"{s}_addr")):
                host = getattr(config, f"{target}_addr").rpartition(":")[0]
                assert host == "127.0.0.1", (container["name"], target, host)
                in_pod_calls.add((container["name"], target))
    assert in_pod_calls == {("scheduler", "worker"), ("detokenizer", "scheduler")}


def test_no_container_dials_an_address_outside_the_derived_graph(layout: list[Doc]) -> None:
    # An address option not named after a service (the gateway's
    # prefill_scheduler_addr: a prefill replica) would dial a pod the
    # policies do not know of; set here, it needs its own rule first.
    shared = {k: str(v) for k, v in _config_map(layout)["data"].items()}
    for deployment in _deployments(layout):
        for container in _containers(deployment):
            env = {v["name"]: v["value"] for v in container.get("env", [])}
            config = build_config(container["name"], shared | env)
            outside = {
                f.name
                for f in dataclasses.fields(config)
                if f.name.endswith("_addr")
                and f.name.removesuffix("_addr") not in SERVICE_CONFIGS
                and getattr(config, f.name)
                # Loopback (worker ranks' rendezvous, dist_init_addr) stays in the pod.
                and not getattr(config, f.name).startswith("127.0.0.1:")
            }
            assert not outside, (container["name"], outside)


# ---- Secrets -----------------------------------------------------------------


def test_every_container_reads_the_token_and_mounts_the_tls_secret(layout: list[Doc]) -> None:
    for deployment in _deployments(layout):
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in _containers(deployment):
            where = (deployment["metadata"]["name"], container["name"])
            sources = container["envFrom"]
            secret_refs = [s["secretRef"]["name"] for s in sources if "secretRef" in s]
            assert secret_refs == [AUTH_SECRET], where
            (mount,) = [m for m in container.get("volumeMounts", []) if m["name"] in volumes]
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == TLS_SECRET, where
            # TLS is off until configured: a cluster without the Secret still runs.
            assert secret["optional"] is True, where
            assert mount["readOnly"] is True, where
            assert PurePosixPath(mount["mountPath"]) == TLS_MOUNT_PATH, where


def test_the_configmaps_tls_lines_name_the_mounted_secrets_files(k8s_docs: list[Doc]) -> None:
    settings = _commented_tls_settings()
    expected = {env_name(o): str(TLS_MOUNT_PATH / key) for o, key in TLS_FILE_KEYS.items()}
    assert settings == expected
    (_, tls_example) = _example_secrets()
    assert set(TLS_FILE_KEYS.values()) == set(tls_example["stringData"])
    # Uncommented, they make a valid config for every service.
    shared = {k: str(v) for k, v in _config_map(k8s_docs)["data"].items()} | settings
    for service in SERVICE_CONFIGS:
        config = build_config(service, shared)
        assert [getattr(config, o) for o in TLS_FILE_KEYS] == list(expected.values()), service


def test_the_secret_example_holds_placeholders_and_stays_out_of_kustomize(
    layout: list[Doc],
) -> None:
    text = (K8S_DIR / SECRET_EXAMPLE).read_text()
    assert "BEGIN" not in text  # no PEM material, real or not
    for secret in _example_secrets():
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        assert all(v.startswith("<") and v.endswith(">") for v in secret["stringData"].values())
    for folder in (K8S_BASE, *(K8S_DIR / "overlays" / name for name in K8S_OVERLAYS)):
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        resources = kustomization.get("resources", [])
        assert not [r for r in resources if r.endswith(SECRET_EXAMPLE)], folder
    assert not [d for d in layout if d["kind"] == "Secret"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_k8s_secret_makes_the_example_shapes_with_fresh_credentials() -> None:
    first, second = stack_secrets(), stack_secrets()
    shapes = [(s["metadata"]["name"], s["type"], set(s["stringData"])) for s in first]
    example = [(s["metadata"]["name"], s["type"], set(s["stringData"])) for s in _example_secrets()]
    assert shapes == example
    for secret in yaml.safe_load_all(render(first)):  # what `kvmesh k8s-secret` prints
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    auth, tls = first
    assert len(auth["stringData"][TOKEN_KEY]) >= 40
    assert auth["stringData"][TOKEN_KEY] != second[0]["stringData"][TOKEN_KEY]
    assert tls["stringData"]["tls.key"].startswith("-----BEGIN PRIVATE KEY-----")
    assert tls["stringData"]["ca.crt"] != second[1]["stringData"]["ca.crt"]
