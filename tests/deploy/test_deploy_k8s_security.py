"""deploy/k8s security: the Secrets every pod reads, and NetworkPolicies that follow the call graph.

The call graph is derived from services/config/: a service dials another when
its config has that one's ``<name>_addr`` option.
"""

from __future__ import annotations

import shutil
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.config import SERVICE_CONFIGS
from services.k8s_secret import AUTH_SECRET, TLS_SECRET, TOKEN_KEY, render, stack_secrets
from tests.deploy.deploy_facts import K8S_DIR, build_config, declared_ports

Doc = dict[str, Any]
COMPONENT = "app.kubernetes.io/component"
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
K8S_VERSION = "1.37.0"


def _callers(target: str) -> set[str]:
    """The services whose config dials ``target``."""
    return {name for name in SERVICE_CONFIGS if hasattr(build_config(name, {}), f"{target}_addr")}


def _policies(k8s_docs: list[Doc]) -> dict[str | None, Doc]:
    """NetworkPolicies by the component they select (None: every kvmesh pod)."""
    found = [d for d in k8s_docs if d["kind"] == "NetworkPolicy"]
    return {d["spec"]["podSelector"]["matchLabels"].get(COMPONENT): d for d in found}


def _rules_by_port(policy: Doc) -> dict[int, list[Doc] | None]:
    """Ingress port -> its ``from`` peers (None: from anywhere)."""
    rules: dict[int, list[Doc] | None] = {}
    for rule in policy["spec"].get("ingress", []):
        for port in rule["ports"]:
            assert port["port"] not in rules, f"port {port['port']} in two rules"
            rules[port["port"]] = rule.get("from")
    return rules


def _example_secrets() -> list[Doc]:
    return list(yaml.safe_load_all((K8S_DIR / "secret.example.yaml").read_text()))


def test_ingress_is_denied_to_every_kvmesh_pod_but_what_a_policy_allows(
    k8s_docs: list[Doc],
) -> None:
    deny = _policies(k8s_docs)[None]
    assert deny["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvmesh"}
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]


def test_each_internal_port_admits_exactly_the_services_that_dial_it(k8s_docs: list[Doc]) -> None:
    policies = _policies(k8s_docs)
    assert set(policies) == {None, *SERVICE_CONFIGS}
    for name in set(SERVICE_CONFIGS) - {"gateway"}:
        ports = declared_ports(name)
        rules = _rules_by_port(policies[name])
        assert set(rules) == {ports.grpc, ports.metrics}, name
        callers = {peer["podSelector"]["matchLabels"][COMPONENT] for peer in rules[ports.grpc]}
        assert callers == _callers(name), name
        assert callers, f"{name}: nobody dials it, yet it has a port"
        assert rules[ports.metrics] == [{"namespaceSelector": {"matchLabels": MONITORING}}], name


def test_only_the_gateway_public_ports_are_open_to_all(k8s_docs: list[Doc]) -> None:
    ports = declared_ports("gateway")
    assert _rules_by_port(_policies(k8s_docs)["gateway"]) == {ports.http: None, ports.grpc: None}


def test_every_deployment_reads_the_token_and_mounts_the_tls_secret(k8s_docs: list[Doc]) -> None:
    for deployment in (d for d in k8s_docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        secret_refs = [s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s]
        assert secret_refs == [AUTH_SECRET], deployment["metadata"]["name"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mount = next(m for m in container["volumeMounts"] if m["name"] in volumes)
        assert volumes[mount["name"]]["secret"]["secretName"] == TLS_SECRET
        assert mount["readOnly"] is True


def test_the_secret_example_holds_placeholders_and_stays_out_of_kustomize() -> None:
    text = (K8S_DIR / "secret.example.yaml").read_text()
    assert "BEGIN" not in text  # no PEM material, real or not
    for secret in _example_secrets():
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        assert all(v.startswith("<") and v.endswith(">") for v in secret["stringData"].values())
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in kustomization["resources"]


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
