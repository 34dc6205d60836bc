"""Credentials of one stack: a random internal token, and a private CA with one certificate.

The certificate is issued for ``kvmesh-internal`` (what every internal client
checks, ``--internal-tls-server-name``), ``localhost`` and ``127.0.0.1``, for
both server and client use: every service presents the same one, and holding
a certificate of the stack's CA is what makes a caller part of the stack. The
CA's key signs it and is deleted at once, so nothing can issue another.

Made with the ``openssl`` command (the ``cryptography`` package is not a
dependency of kvmesh): ``kvmesh up --internal-tls`` for a local stack, and
``kvmesh k8s-secret`` for a Kubernetes Secret (``deploy/k8s/secret.example.yaml``).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvmesh.services.runtime.config import INTERNAL_TLS_SERVER_NAME

_SUBJECT_ALT_NAMES = f"DNS:{INTERNAL_TLS_SERVER_NAME},DNS:localhost,IP:127.0.0.1"
_CA_DAYS = 3650
_CERT_DAYS = 825  # the longest validity clients commonly accept for a leaf
# Elliptic-curve keys: small, fast handshakes, accepted by gRPC (BoringSSL) and uvicorn.
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def new_token() -> str:
    """A fresh ``--internal-auth-token``: 256 random bits."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class StackCertificates:
    """One stack's PEM files: its CA's certificate, and every service's certificate and key."""

    ca_certs: Path
    certfile: Path
    keyfile: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("making a stack's certificates needs the openssl command on PATH")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def make_stack_certificates(folder: Path) -> StackCertificates:
    """Write ``ca.crt``, ``tls.crt`` and ``tls.key`` into ``folder`` (which should be private)."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.crt",
        "-days", str(_CA_DAYS), "-subj", "/CN=kvmesh stack CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "req", *_KEY, "-keyout", "tls.key", "-out", "tls.csr",
        "-subj", f"/CN={INTERNAL_TLS_SERVER_NAME}",
        cwd=folder,
    )  # fmt: skip
    (folder / "tls.ext").write_text(
        f"subjectAltName={_SUBJECT_ALT_NAMES}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "tls.crt", "-days", str(_CERT_DAYS), "-extfile", "tls.ext",
        cwd=folder,
    )  # fmt: skip
    for leftover in ("ca.key", "ca.srl", "tls.csr", "tls.ext"):
        (folder / leftover).unlink(missing_ok=True)
    (folder / "tls.key").chmod(0o600)
    return StackCertificates(folder / "ca.crt", folder / "tls.crt", folder / "tls.key")
