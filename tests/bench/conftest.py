"""Fixtures: the fake streaming server (one per session) and the default model's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.services.cli.bench.dataset import BenchTokenizer
from kvmesh.services.runtime.model_prep import default_model_path
from tests.bench.fake_openai_server import FakeOpenAIServer


@pytest.fixture(scope="session")
def fake_server_session() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fake_server(fake_server_session: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_server_session.reset()
    return fake_server_session


@pytest.fixture(scope="session")
def bench_tokenizer() -> BenchTokenizer:
    path = default_model_path()
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"default model not prepared at {path}")
    return BenchTokenizer.from_path(path)
