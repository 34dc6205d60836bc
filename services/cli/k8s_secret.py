"""``kvmesh k8s-secret``: the Secrets of a Kubernetes stack, with fresh credentials.

    kvmesh k8s-secret | kubectl apply -f -

Prints two Secrets (the shapes of ``deploy/k8s/secret.example.yaml``, which
holds placeholders only): ``kvmesh-internal-auth`` with a random
``KVMESH_INTERNAL_AUTH_TOKEN`` that every Deployment reads through
``envFrom``, and ``kvmesh-internal-tls`` with a private CA's certificate and
one certificate and key for every service (``services/runtime/stack_credentials.py``),
mounted for mutual TLS. Nothing is written to disk but a private temporary
folder, removed before the command returns; the CA's key is never kept.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from kvmesh.services.runtime.config import env_name
from kvmesh.services.runtime.stack_credentials import make_stack_certificates, new_token

AUTH_SECRET = "kvmesh-internal-auth"
TLS_SECRET = "kvmesh-internal-tls"
TOKEN_KEY = env_name("internal_auth_token")
_LABELS = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/part-of": "kvmesh"}


def _secret(name: str, secret_type: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": dict(_LABELS)},
        "type": secret_type,
        "stringData": data,
    }


def stack_secrets() -> list[dict[str, Any]]:
    """The two Secrets, with a new token and new certificates."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-k8s-") as folder:
        certificates = make_stack_certificates(Path(folder))
        tls = {
            "ca.crt": certificates.ca_certs.read_text(),
            "tls.crt": certificates.certfile.read_text(),
            "tls.key": certificates.keyfile.read_text(),
        }
    return [
        _secret(AUTH_SECRET, "Opaque", {TOKEN_KEY: new_token()}),
        _secret(TLS_SECRET, "kubernetes.io/tls", tls),
    ]


def _literal_blocks(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None  # PEM files stay readable
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def render(docs: list[dict[str, Any]]) -> str:
    class _Dumper(yaml.SafeDumper):
        pass

    _Dumper.add_representer(str, _literal_blocks)
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def main() -> int:
    sys.stdout.write(render(stack_secrets()))
    return 0
