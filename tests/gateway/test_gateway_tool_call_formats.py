"""Each family's tool-call format through the gateway, as the OpenAI client assembles it.

The fake engine replays a recorded-style generation token by token (the
default model's tokenizer splits it); the official client reads the response
whole and streamed (``chat.completions.stream`` accumulates the deltas), and
both must equal the expected calls: two parallel calls, in order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvmesh.gateway.engine.client import ModelInfo
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME
from tests.gateway.tool_call_samples import MALFORMED, SAMPLES, TOOLS, Sample

ASK = [{"role": "user", "content": "Weather in Paris for 3 days, and the time in CET?"}]


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngineClient:
    """The fake engine with room for the tools in the prompt and a whole generation."""
    info = ModelInfo(
        served_model_name=MODEL_NAME,
        max_model_len=2048,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return FakeEngineClient(
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), info=info
    )


def _client(engine: FakeEngineClient, tokenizer: Tokenizer, parser: str) -> openai.AsyncOpenAI:
    parsing = OutputParsing(tool_parser=TOOL_PARSERS[parser], auto_tool_choice=True)
    app: FastAPI = build_app(
        engine,
        tokenizer,
        MODEL_NAME,
        metrics_registry=CollectorRegistry(),
        output_parsing=parsing,
    )
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
        max_retries=0,
    )


@pytest.fixture
async def clients(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    made = {name: _client(engine, tokenizer, name) for name in TOOL_PARSERS}
    yield made
    for client in made.values():
        await client.close()


def _script(engine: FakeEngineClient, tokenizer: Tokenizer, text: str) -> None:
    engine.script = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _calls(message: object) -> list[tuple[str, dict]]:
    tool_calls = getattr(message, "tool_calls", None) or []
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda sample: sample.id)
async def test_calls_come_back_whole_and_streamed_alike(
    clients: dict[str, openai.AsyncOpenAI],
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    sample: Sample,
) -> None:
    _script(engine, tokenizer, sample.text)
    client = clients[sample.parser]
    whole = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert _calls(choice.message) == sample.calls
    assert choice.message.content == sample.content
    assert choice.finish_reason == "tool_calls"
    ids = [call.id for call in choice.message.tool_calls or []]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)

    async with client.chat.completions.stream(
        model=MODEL_NAME, messages=ASK, tools=TOOLS
    ) as stream:
        num_argument_deltas = 0
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                num_argument_deltas += 1
        streamed = await stream.get_final_completion()
    streamed_choice = streamed.choices[0]
    assert _calls(streamed_choice.message) == sample.calls
    assert (streamed_choice.message.content or None) == sample.content
    assert streamed_choice.finish_reason == "tool_calls"
    assert num_argument_deltas >= len(sample.calls)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
async def test_malformed_output_is_plain_content(
    clients: dict[str, openai.AsyncOpenAI],
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    parser: str,
    text: str,
) -> None:
    _script(engine, tokenizer, text)
    client = clients[parser]
    whole = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    assert whole.choices[0].message.content == text
    assert not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop"
    # A stream cannot take back a call it started; it must still end cleanly.
    async with client.chat.completions.stream(
        model=MODEL_NAME, messages=ASK, tools=TOOLS
    ) as stream:
        streamed = await stream.get_final_completion()
    choice = streamed.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls")
    if not choice.message.tool_calls:
        assert choice.finish_reason == "stop"
        assert choice.message.content == text


async def test_plain_answers_stream_as_content_with_every_parser(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    text = "It is sunny in Paris [1]; {see below} <b>today</b>."
    _script(engine, tokenizer, text)
    for client in clients.values():
        async with client.chat.completions.stream(
            model=MODEL_NAME, messages=ASK, tools=TOOLS
        ) as stream:
            streamed = await stream.get_final_completion()
        assert streamed.choices[0].message.content == text
        assert not streamed.choices[0].message.tool_calls


async def test_auto_without_the_flag_is_refused_as_vllm_does(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    for extra in ({}, {"tool_choice": "auto"}):
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 2, **extra}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in error["message"]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("none", "required", named):
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 30, "tool_choice": choice}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    assert all(r.detokenize_params.skip_special_tokens for r in engine.requests)


async def test_formats_with_special_token_markers_keep_them_in_the_text(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    _script(engine, tokenizer, "ok")
    for name, client in clients.items():
        await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=5
        )
        skipped = engine.requests[-1].detokenize_params.skip_special_tokens
        assert skipped is not TOOL_PARSERS[name].keeps_special_tokens, name
        await client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=5)
        assert engine.requests[-1].detokenize_params.skip_special_tokens  # no tools: untouched
