"""Bounded cost per call: --max-n, --max-tokens-limit, --max-tokens-per-request (issue 43).

Each bound refuses with a 400 that names the field and the flag, before the
engine sees anything, and /openapi.json states the bound, so a fuzzer that
follows the schema never sends a call the server would take minutes over.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MAX_MODEL_LEN, MODEL_NAME

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}


def _client(engine: FakeEngineClient, tokenizer: Tokenizer, **limits: int) -> httpx.AsyncClient:
    app = build_app(
        engine, tokenizer, MODEL_NAME, CollectorRegistry(), limits=GatewayLimits(**limits)
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def _refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


async def test_n_past_max_n_is_400_naming_the_flag(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    async with _client(engine, tokenizer, max_n=4) as http:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            error = _refusal(await http.post(path, json={**body, "n": 5}))
            assert error["param"] == "n" and "--max-n" in error["message"]
            assert error["type"] == "invalid_request_error"
        error = _refusal(await http.post("/v1/completions", json={**COMPLETION, "best_of": 5}))
        assert error["param"] in ("n", "best_of")
        assert not engine.requests  # refused before the engine
        ok = await http.post("/v1/chat/completions", json={**CHAT, "n": 4, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 4


async def test_max_tokens_past_the_limit_is_400_and_caps_the_default(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    async with _client(engine, tokenizer, max_tokens_limit=8) as http:
        error = _refusal(await http.post("/v1/completions", json={**COMPLETION, "max_tokens": 9}))
        assert error["param"] == "max_tokens" and "--max-tokens-limit" in error["message"]
        error = _refusal(
            await http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 9})
        )
        assert error["param"] == "max_completion_tokens"
        assert not engine.requests
        # A chat that names no max_tokens gets the room left, capped by the limit
        # (not refused: it asked for nothing past it); completions' default of 16 too.
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        body = {"prompt": "Once upon a time"}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    assert [r.sampling_params.max_tokens for r in engine.requests] == [8, 8]


async def test_a_call_holding_too_many_tokens_is_400(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    prompt_len = len(tokenizer.encode("Once upon a time", add_special_tokens=True))
    per_choice = prompt_len + 4
    async with _client(engine, tokenizer, max_tokens_per_request=3 * per_choice) as http:
        # Three prompts x n=1 fit exactly; two prompts x n=2 do not.
        fits = {**COMPLETION, "prompt": ["Once upon a time"] * 3}
        assert (await http.post("/v1/completions", json=fits)).status_code == 200
        past = {**COMPLETION, "prompt": ["Once upon a time"] * 2, "n": 2}
        error = _refusal(await http.post("/v1/completions", json=past))
        assert error["param"] == "max_tokens"
        assert f"{4 * per_choice} tokens" in error["message"]
        assert "--max-tokens-per-request" in error["message"]
    assert len(engine.requests) == 3


async def test_the_schema_states_the_bounds(engine: FakeEngineClient, tokenizer: Tokenizer) -> None:
    async with _client(
        engine, tokenizer, max_n=3, max_tokens_limit=50, max_tokens_per_request=999
    ) as http:
        schema = (await http.get("/openapi.json")).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        request = schema["components"]["schemas"][name]
        assert request["x-max-tokens-per-request"] == 999
        assert request["properties"]["n"]["maximum"] == 3
        assert request["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 50
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 50
    best_of = schema["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"]
    assert best_of["anyOf"][0]["maximum"] == 3


@pytest.mark.parametrize("limit", [0, MAX_MODEL_LEN + 10])
def test_without_a_tighter_limit_the_context_bounds_max_tokens(limit: int) -> None:
    assert GatewayLimits(max_tokens_limit=limit).max_output_len(MAX_MODEL_LEN) == MAX_MODEL_LEN - 1
