"""The stack's security, end to end through ``kvmesh up``.

- The default stack (the session's ``stack``, as every e2e test runs it)
  authenticates internal calls with a token made for it: a process outside it
  can neither step the worker nor read the detokenizer's outputs.
- ``--internal-tls`` adds mutual TLS, and ``--ssl-*`` puts TLS on the public
  HTTP and gRPC ports; ``--gateway-metrics-port`` moves /metrics off the
  public port.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.protos import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvmesh.services.cli.local_stack import LocalStack, free_ports
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel
from kvmesh.services.runtime.stack_credentials import StackCertificates, make_stack_certificates
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.e2e

PROMPT = "The three primary colors are"


async def _no_steps() -> AsyncIterator[worker_pb2.StepRequest]:
    """An Execute stream that sends nothing: the worker refuses (or accepts) a
    stream before reading from it, and a step sent while it refuses races the
    refusal (the client may then see the RST_STREAM, INTERNAL, not the status)."""
    await asyncio.Event().wait()
    yield worker_pb2.StepRequest(step_id=1)  # never reached: the call ends first


async def _worker_step_code(address: str, security: InternalSecurity) -> grpc.StatusCode:
    """How the worker answers an Execute stream (a would-be scheduler) from ``security``."""
    async with internal_channel(address, security) as channel:
        steps = worker_pb2_grpc.WorkerStub(channel).Execute(_no_steps(), timeout=10)
        try:
            async for _ in steps:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _outputs_code(address: str, security: InternalSecurity) -> grpc.StatusCode:
    """How the detokenizer answers a subscription to its outputs from ``security``."""
    async with internal_channel(address, security) as channel:
        stream = detokenizer_pb2_grpc.DetokenizerStub(channel).StreamDetokenized(
            detokenizer_pb2.StreamDetokenizedRequest(client_id="e2e-outsider")
        )
        try:
            await asyncio.wait_for(stream.wait_for_connection(), timeout=10)
            # Subscribed: nothing else to read, so the call is cancelled by the test.
            stream.cancel()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _internal_codes(stack: LocalStack, security: InternalSecurity) -> tuple[str, str]:
    worker = f"127.0.0.1:{stack.ports['worker_port']}"
    detokenizer = f"127.0.0.1:{stack.ports['detokenizer_port']}"
    return (
        asyncio.run(_worker_step_code(worker, security)).name,
        asyncio.run(_outputs_code(detokenizer, security)).name,
    )


def test_the_default_stack_refuses_outsiders_and_serves_itself(stack: LocalStack) -> None:
    security = stack.internal_security()
    assert security.token and not security.mutual_tls  # made by the launcher
    assert _internal_codes(stack, NO_INTERNAL_AUTH) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
    assert _internal_codes(stack, InternalSecurity(token="guessed")) == (
        "UNAUTHENTICATED",
        "UNAUTHENTICATED",
    )
    # With the token: past the check (the worker keeps its one scheduler stream).
    assert _internal_codes(stack, security) == ("FAILED_PRECONDITION", "OK")
    reply = httpx.post(
        f"{stack.http_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def public_certificates(tmp_path_factory: pytest.TempPathFactory) -> StackCertificates:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    return make_stack_certificates(Path(tmp_path_factory.mktemp("public-tls")))


@pytest.fixture(scope="module")
def tls_stack(public_certificates: StackCertificates) -> Iterator[tuple[LocalStack, int]]:
    (metrics_port,) = free_ports(1)
    stack = start_stack(
        [
            "--num-kv-blocks", "256", "--max-model-len", "1024",
            "--internal-tls",
            "--ssl-certfile", str(public_certificates.certfile),
            "--ssl-keyfile", str(public_certificates.keyfile),
            "--gateway-metrics-port", str(metrics_port),
        ]
    )  # fmt: skip
    yield stack, metrics_port
    assert stop_stack(stack) == 0, "".join(stack.log[-50:])


def test_tls_stack_serves_over_https_and_grpc_tls(
    tls_stack: tuple[LocalStack, int], public_certificates: StackCertificates
) -> None:
    stack, metrics_port = tls_stack
    https_url = stack.http_url.replace("http://", "https://")
    verify = ssl.create_default_context(cafile=str(public_certificates.ca_certs))
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{https_url}/v1/completions", json=body, timeout=120, verify=verify)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(httpx.HTTPError):  # plaintext on the TLS port
        httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=10)
    # /metrics lives on its own port, off the public one.
    assert httpx.get(f"{https_url}/metrics", verify=verify).status_code == 404
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    assert "vllm:request_success_total" in scraped.text
    credentials = grpc.ssl_channel_credentials(public_certificates.ca_certs.read_bytes())
    with grpc.secure_channel(stack.grpc_addr, credentials) as channel:
        request = generation_pb2.GenerateRequest(
            text=PROMPT,
            sampling=generation_pb2.SamplingParameters(max_tokens=3, temperature=0.0),
        )
        replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert replies[-1].usage.completion_tokens == 3


def test_tls_stack_internal_ports_need_the_certificate_and_the_token(
    tls_stack: tuple[LocalStack, int],
) -> None:
    stack, _ = tls_stack
    security = stack.internal_security()
    assert security.mutual_tls and security.token
    # Plaintext: no TLS handshake at all.
    assert _internal_codes(stack, NO_INTERNAL_AUTH) == ("UNAVAILABLE", "UNAVAILABLE")
    certificate_only = InternalSecurity(
        certfile=security.certfile, keyfile=security.keyfile, ca_certs=security.ca_certs
    )
    assert _internal_codes(stack, certificate_only) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
    assert _internal_codes(stack, security) == ("FAILED_PRECONDITION", "OK")
