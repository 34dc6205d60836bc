"""deploy/k8s/overlays/shared-kv: the kvstore's shared-filesystem tier on a ReadWriteMany claim.

Rendered by kubectl's kustomize and checked against the Kubernetes schemas as
tests/deploy/test_deploy_k8s.py checks the other layouts (it is not among them:
their tests assume one volume per pod and spread rules per layout name); then:
the kvstore mounts the claim where its config says, the config builds, the bound
fits the claim, and the pod's user can write the volume.
"""

from __future__ import annotations

import shutil
from typing import Any

import kubernetes_validate
import pytest

from kvmesh.services.runtime.config import KVStoreConfig
from tests.deploy.deploy_facts import K8S_DIR, build_config, render_kustomization

Doc = dict[str, Any]

_BINARY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _bytes(quantity: str) -> int:
    for suffix, factor in _BINARY_UNITS.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    raise AssertionError(f"write the claim's size in Ki/Mi/Gi/Ti, not {quantity!r}")


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (kustomize built in) is not installed: overlays cannot be rendered")
    return render_kustomization(K8S_DIR / "overlays" / "shared-kv")


@pytest.mark.parametrize("version", ["1.27.0", "1.37.0"])
def test_overlay_matches_the_kubernetes_schemas(docs: list[Doc], version: str) -> None:
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":  # a CRD: no schema there
            kubernetes_validate.validate(doc, version, strict=True)


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_kvstore_mounts_a_read_write_many_claim_at_its_shared_fs_path(docs: list[Doc]) -> None:
    deployment = _one(docs, "Deployment", "kvmesh-kvstore")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_map = {k: str(v) for k, v in _one(docs, "ConfigMap", "kvmesh-config")["data"].items()}
    env = {v["name"]: v["value"] for v in container.get("env", [])}
    config: KVStoreConfig = build_config("kvstore", config_map | env)
    assert config.kvstore_shared_fs_path and not config.kvstore_disk_path

    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == config.kvstore_shared_fs_path
    ]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = _one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # The bound leaves the claim headroom for other kvstores' writes between listings.
    size = _bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert config.kvstore_shared_fs_bytes <= 0.9 * size

    # The kvstore's user can write the volume (where the volume type honours fsGroup).
    security = pod["securityContext"]
    assert security["fsGroup"] == security["runAsGroup"]


def test_an_update_starts_the_new_kvstore_beside_the_old_one(docs: list[Doc]) -> None:
    strategy = _one(docs, "Deployment", "kvmesh-kvstore")["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_the_other_layouts_keep_the_kvstore_in_memory(rendered_k8s: dict[str, list[Doc]]) -> None:
    for layout in ("base", "one-node", "fleet"):
        deployment = _one(rendered_k8s[layout], "Deployment", "kvmesh-kvstore")
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, layout
        assert not [d for d in rendered_k8s[layout] if d["kind"] == "PersistentVolumeClaim"]
