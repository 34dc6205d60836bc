"""/openapi.json tells the truth: what it documents is what the gateway accepts and answers.

The main test runs `schemathesis run --checks all` (bounded examples, a fixed
seed) against the real app over HTTP, with the fake engine behind it: no answer
may be a 5xx (`not_a_server_error`, part of `all`), every
documented status, content type and body is checked, schema-valid requests
must be accepted (and reach the engine), schema-invalid ones refused with the
documented 400. The cross-field rules no JSON Schema can state are in
tests/gateway/schemathesis_hooks.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.openapi_schema import decimal_below
from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from kvmesh.services.cli.local_stack import REPO_ROOT, free_ports
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN, MODEL_NAME

SCHEMATHESIS_EXAMPLES = 25


@pytest.fixture
def served(engine: FakeEngineClient, tokenizer: Tokenizer) -> Iterator[str]:
    """The gateway app on a loopback port (uvicorn in a thread); yields its base URL."""
    # With auto tool choice, as `--enable-auto-tool-choice` serves the default model.
    parsing = OutputParsing(tool_parser=TOOL_PARSERS["hermes"], auto_tool_choice=True)
    app = build_app(
        engine,
        tokenizer,
        MODEL_NAME,
        metrics_registry=CollectorRegistry(),
        output_parsing=parsing,
    )
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_schemathesis_checks_all_pass_and_valid_requests_reach_the_engine(
    served: str, engine: FakeEngineClient
) -> None:
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.gateway.schemathesis_hooks",
        "PYTHONPATH": str(REPO_ROOT),
    }
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{served}/openapi.json"),
        *("--checks", "all", "--max-examples", str(SCHEMATHESIS_EXAMPLES)),
        *("--workers", "1", "--seed", "1", "--no-color", "--generation-database", "none"),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "No issues found" in done.stdout
    # Schema-valid generations were accepted and generated (not refused before the engine).
    completions = [r for r in engine.requests if r.request_id.startswith("cmpl-")]
    chats = [r for r in engine.requests if r.request_id.startswith("chatcmpl-")]
    responses = [r for r in engine.requests if r.request_id.startswith("resp_")]
    assert len(completions) >= 20 and len(chats) >= 20 and len(responses) >= 20


def _schema(served: str) -> dict:
    return httpx.get(f"{served}/openapi.json").json()


def test_schema_states_the_served_model_and_its_limits(served: str, tokenizer: Tokenizer) -> None:
    schema = _schema(served)
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["model"]["anyOf"][0]["enum"] == [MODEL_NAME]
    assert request["max_tokens"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_MODEL_LEN - 1,
    }
    token_id = request["stop_token_ids"]["anyOf"][0]["items"]
    assert token_id == {"type": "integer", "minimum": 0, "maximum": tokenizer.vocab_size - 1}
    assert request["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert "x-kvmesh-limit" not in str(schema)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], f"{method} {path} documents a 422"
            if "requestBody" in operation:
                error = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert error == {"$ref": "#/components/schemas/ErrorResponse"}


def test_out_of_int32_values_are_400_not_500(served: str) -> None:
    for field in ("top_k", "priority"):
        response = httpx.post(
            f"{served}/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: 2**40}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_wrong_method_names_the_allowed_ones_and_probes_have_content_types(served: str) -> None:
    response = httpx.request("TRACE", f"{served}/v1/models")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET"
    health = httpx.get(f"{served}/health")
    assert health.headers["content-type"] == "application/json"
    assert health.json() == {"status": "ok"}
    metrics = httpx.get(f"{served}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    schema = _schema(served)
    documented = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(documented) == ["text/plain"]


@pytest.mark.parametrize("limit", [1, 7, 10, 11, 100, 49152, 151_936])
def test_decimal_below_matches_exactly_the_integers_under_the_limit(limit: int) -> None:
    pattern = re.compile(decimal_below(limit))
    numbers = {0, 1, 9, 10, 99, 100, limit - 1, limit, limit + 1, 10 * limit}
    numbers |= set(range(max(0, limit - 30), limit + 30))
    for number in numbers:
        assert bool(pattern.match(str(number))) == (number < limit), number
    assert not pattern.match("01") and not pattern.match("") and not pattern.match("-1")


def test_schema_covers_the_responses_api(served: str) -> None:
    schema = _schema(served)
    assert set(schema["paths"]["/v1/responses"]) == {"post"}
    assert set(schema["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    create = schema["paths"]["/v1/responses"]["post"]
    created = create["responses"]["200"]
    assert set(created["content"]) == {"application/json", "text/event-stream"}
    assert set(created["links"]) == {"GetResponse", "DeleteResponse"}
    request = schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert request["max_output_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    wrong = httpx.request("PUT", f"{served}/v1/responses/resp_x")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "DELETE, GET"
