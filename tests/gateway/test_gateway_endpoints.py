"""The non-generation routes: models, health, version, tokenize/detokenize, metrics, API key."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.protocol import BATCH_INVARIANT_COST
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.runtime.model_prep import default_model_path
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN, MODEL_NAME


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL_NAME
    assert card["object"] == "model"
    assert isinstance(card["created"], int)
    assert card["owned_by"]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["quantization"] is None  # the fake engine holds its weights as they are


async def test_models_reports_how_the_weights_are_held(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    engine.info = dataclasses.replace(engine.info, quantization="gguf")
    app = build_app(engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        (card,) = (await http.get("/v1/models")).json()["data"]
    assert card["quantization"] == "gguf"


async def test_models_reports_batch_invariant_mode_and_its_cost(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    (card,) = (await client.get("/v1/models")).json()["data"]
    assert card["batch_invariant"] is None and card["batch_invariant_cost"] is None
    engine.info = dataclasses.replace(engine.info, batch_invariant=True)
    app = build_app(engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        (card,) = (await http.get("/v1/models")).json()["data"]
    assert card["batch_invariant"] is True
    assert card["batch_invariant_cost"] == BATCH_INVARIANT_COST
    assert "tok/s" in card["batch_invariant_cost"]


async def test_health_and_version(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    version = (await client.get("/version")).json()["version"]
    assert isinstance(version, str) and version


async def test_tokenize_prompt_and_detokenize_round_trip(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    text = "Tokenizers split text into pieces."
    body = (await client.post("/tokenize", json={"prompt": text})).json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert "token_strs" not in body
    back = (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert back == {"prompt": text}


async def test_tokenize_messages_uses_the_chat_template(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    hf = AutoTokenizer.from_pretrained(str(default_model_path()))
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    body = (
        await client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    ).json()
    assert body["tokens"] == hf.encode(expected, add_special_tokens=False)
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])


async def test_tokenizer_routes_refuse_bad_input(client: httpx.AsyncClient) -> None:
    neither = await client.post("/tokenize", json={})
    assert neither.status_code == 400
    assert neither.json()["error"]["param"] == "prompt"
    out_of_vocab = await client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert out_of_vocab.status_code == 400
    assert out_of_vocab.json()["error"]["param"] == "tokens"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_count_a_finished_request_under_vllm_names(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": "Counting tokens is fun", "max_tokens": 4, "n": 2}
    )
    usage = response.json()["usage"]
    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    samples = _samples(metrics.text)
    model = (("model_name", MODEL_NAME),)

    def value(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return samples[(name, labels)]

    # Two engine requests, each with the prompt and 4 generated tokens.
    assert value("vllm:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert value("vllm:generation_tokens_total") == usage["completion_tokens"] == 8
    success = (("finished_reason", "length"), ("model_name", MODEL_NAME))
    assert value("vllm:request_success_total", success) == 2
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert value(f"{histogram}_count") == 2, histogram
    assert value("vllm:request_generation_tokens_sum") == 8
    # 4 tokens per request, one per delta: 3 gaps each.
    assert value("vllm:inter_token_latency_seconds_count") == 6


async def test_api_key_guards_openai_routes_only(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    app = build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry(), api_key="sekrit"
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        body: dict[str, Any] = {"prompt": "hi there", "max_tokens": 1}
        missing = await http.post("/v1/completions", json=body)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        wrong = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer x"})
        assert wrong.status_code == 401
        right = await http.post(
            "/v1/completions", json=body, headers={"authorization": "Bearer sekrit"}
        )
        assert right.status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
    assert len(engine.requests) == 1


async def test_metrics_leave_the_public_port_when_served_elsewhere(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    # --gateway-metrics-port (or --no-expose-metrics): the HTTP app has no /metrics.
    app = build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry(), serve_metrics=False
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        assert (await http.get("/metrics")).status_code == 404
        assert (await http.get("/health")).status_code == 200
