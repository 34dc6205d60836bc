"""LoRA adapters at the gateway: chosen by model=name, listed by /v1/models, loaded
and unloaded while serving with vLLM's answers, behind the API key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import save_file

from kvmesh.gateway.engine_params.served_models import ServedModels, read_lora_request
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.server import served_models
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_files import adapter_id
from kvmesh.services.runtime.config import GatewayConfig
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

KEY = "secret"


def write_adapter(folder: Path, rank: int = 4, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(rank, 8, generator=generator),
            f"{prefix}.lora_B.weight": torch.randn(8, rank, generator=generator),
        },
        str(folder / "adapter_model.safetensors"),
    )
    return folder


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    return {name: write_adapter(tmp_path / name, seed=i) for i, name in enumerate(["sql", "chat"])}


@pytest.fixture
def models(adapters: dict[str, Path]) -> ServedModels:
    models = ServedModels(MODEL_NAME, lora_enabled=True)
    models.add(read_lora_request("sql", str(adapters["sql"])))
    return models


@pytest.fixture
async def lora_client(
    engine: FakeEngineClient, tokenizer, models
) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(
        engine,
        tokenizer,
        MODEL_NAME,
        metrics_registry=CollectorRegistry(),
        api_key=KEY,
        models=models,
    )
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://gw", headers=headers
    ) as http:
        yield http


async def _complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post(
        "/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 2}
    )


async def test_model_name_selects_the_adapter(lora_client, engine, adapters) -> None:
    answer = await _complete(lora_client, "sql")
    assert answer.status_code == 200
    assert answer.json()["model"] == "sql"  # vLLM answers with the adapter's name
    assert (await _complete(lora_client, MODEL_NAME)).status_code == 200
    adapter_request, base_request = engine.requests
    lora = adapter_request.lora_request
    assert lora is not None and lora.lora_name == "sql"
    assert lora.lora_id == adapter_id(adapters["sql"])
    assert lora.lora_path == str(adapters["sql"].resolve())
    assert base_request.lora_request is None
    missing = await _complete(lora_client, "chat")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


async def test_models_lists_adapters_with_their_parent(lora_client, adapters) -> None:
    cards = (await lora_client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL_NAME, None), ("sql", MODEL_NAME)]
    assert cards[1]["root"] == str(adapters["sql"].resolve())


async def test_load_and_unload_while_serving(lora_client, engine, adapters) -> None:
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    loaded = await lora_client.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert (await _complete(lora_client, "chat")).status_code == 200
    assert engine.requests[-1].lora_request.lora_id == adapter_id(adapters["chat"])
    ids = [c["id"] for c in (await lora_client.get("/v1/models")).json()["data"]]
    assert ids == [MODEL_NAME, "sql", "chat"]

    unloaded = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert unloaded.status_code == 200
    assert unloaded.text == "Success: LoRA adapter 'chat' removed successfully."
    assert (await _complete(lora_client, "chat")).status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"lora_name": "sql", "lora_path": "ADAPTER"}, 400, "has already been loaded"),
        ({"lora_name": MODEL_NAME, "lora_path": "ADAPTER"}, 400, "has already been loaded"),
        ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "no adapter_config.json"),
        ({"lora_name": "", "lora_path": "ADAPTER"}, 400, "must be provided"),
    ],
)
async def test_load_refusals(lora_client, adapters, body, status, message) -> None:
    body = {k: str(adapters["chat"]) if v == "ADAPTER" else v for k, v in body.items()}
    response = await lora_client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


async def test_unload_of_an_unknown_adapter_is_404(lora_client) -> None:
    response = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."


async def test_adapter_routes_need_the_api_key(lora_client, adapters) -> None:
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = await lora_client.post(path, json=body, headers={"Authorization": "Bearer no"})
        assert response.status_code == 401
    assert [c["id"] for c in (await lora_client.get("/v1/models")).json()["data"]] == [
        MODEL_NAME,
        "sql",
    ]


async def test_without_enable_lora_there_are_no_adapter_routes(client) -> None:
    response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"})
    assert response.status_code == 404


def test_lora_modules_flag_registers_adapters_at_start(adapters) -> None:
    config = GatewayConfig(
        enable_lora=True, lora_modules=(f"sql={adapters['sql']}", f"chat={adapters['chat']}")
    )
    models = served_models(config, MODEL_NAME)
    assert list(models.adapters) == ["sql", "chat"]
    broken = GatewayConfig(enable_lora=True, lora_modules=("bad=/no/such/adapter",))
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        served_models(broken, MODEL_NAME)
