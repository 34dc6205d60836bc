"""Fixtures: the real SmolLM2 tokenizer, a fake engine, and the app behind an ASGI client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvmesh.gateway.engine.client import ModelInfo
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.runtime.model_prep import default_model_path
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN, MODEL_NAME


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    path = default_model_path()
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"default model not prepared at {path}")
    return Tokenizer.from_pretrained(path)


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngineClient:
    info = ModelInfo(
        served_model_name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return FakeEngineClient(
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), info=info
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def app(engine: FakeEngineClient, tokenizer: Tokenizer, registry: CollectorRegistry) -> FastAPI:
    return build_app(engine, tokenizer, MODEL_NAME, metrics_registry=registry)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http
