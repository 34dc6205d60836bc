"""Structured-output fields become one engine constraint; tools are rendered, forced or parsed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from kvmesh.services.contracts.sampling_params import StructuredOutputSpec
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME, parse_sse

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": SCHEMA},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


@pytest.fixture
def app(engine: FakeEngineClient, tokenizer: Tokenizer, registry: CollectorRegistry) -> FastAPI:
    """The gateway as `--enable-auto-tool-choice` serves SmolLM2 (hermes, from its template)."""
    parsing = OutputParsing(tool_parser=TOOL_PARSERS["hermes"], auto_tool_choice=True)
    return build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=registry, output_parsing=parsing
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutputSpec("json", json.dumps(SCHEMA)),
        ),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputSpec("json", json.dumps(SCHEMA))),
        ({"guided_json": SCHEMA}, StructuredOutputSpec("json", json.dumps(SCHEMA))),
        ({"guided_regex": "[a-z]+"}, StructuredOutputSpec("regex", "[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputSpec("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputSpec("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputSpec("regex", "[0-9]+")),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            StructuredOutputSpec("choice", '["a", "b"]'),
        ),
        ({"response_format": {"type": "text"}}, None),
    ],
)
async def test_every_structured_output_field_reaches_the_engine(
    client: httpx.AsyncClient, engine: FakeEngineClient, fields: dict, expected
) -> None:
    for endpoint, base in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": USER})):
        response = await client.post(endpoint, json={**base, "max_tokens": 2, **fields})
        assert response.status_code == 200, response.text
        assert engine.requests[-1].sampling_params.structured_output == expected


async def test_n_siblings_share_one_parallel_group_per_prompt(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    response = await client.post(
        COMPLETIONS, json={"prompt": ["One", "Two"], "n": 3, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    groups = [request.parallel_group for request in engine.requests]
    assert len(set(groups[:3])) == 1 and len(set(groups[3:])) == 1
    assert groups[0] is not None and groups[0] != groups[3]
    await client.post(COMPLETIONS, json={"prompt": "One", "max_tokens": 2})
    assert engine.requests[-1].parallel_group is None


def _prompt_text(engine: FakeEngineClient, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)


async def test_tools_are_rendered_into_the_prompt_unless_tool_choice_is_none(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    body = {"messages": USER, "max_tokens": 2, "tools": [WEATHER]}
    assert (await client.post(CHAT, json=body)).status_code == 200
    # SmolLM2's template ignores tools: they go into the system prompt instead.
    text = _prompt_text(engine, tokenizer)
    assert "<tools>" in text and '"name": "get_weather"' in text and "Weather in Paris?" in text
    assert engine.requests[-1].sampling_params.structured_output is None  # auto: parsed, not forced
    assert (await client.post(CHAT, json={**body, "tool_choice": "none"})).status_code == 200
    assert "<tools>" not in _prompt_text(engine, tokenizer)


async def test_malformed_arguments_in_the_history_do_not_fail_the_request(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Par'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": history, "max_tokens": 2, "tools": [WEATHER]}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    text = _prompt_text(engine, tokenizer)
    assert '"arguments": "{\\"city\\": \\"Par"' in text  # kept as the string sent
    assert "<tool_response>\nsunny\n</tool_response>" in text


def _script(engine: FakeEngineClient, tokenizer: Tokenizer, text: str) -> None:
    engine.script = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


async def test_auto_parses_hermes_calls_into_tool_calls(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    _script(engine, tokenizer, CALL_TEXT)
    body = {"messages": USER, "max_tokens": 60, "tools": [WEATHER, CLOCK]}
    choice = (await client.post(CHAT, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def _streamed_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reassemble streamed tool calls the way the OpenAI client does, checking their shape:
    the first piece of a call has its id, type and name; the others only argument text."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in (c for d in deltas for c in d["delta"].get("tool_calls") or []):
        index = piece["index"]
        if index not in calls:
            assert set(piece) == {"index", "id", "type", "function"}
            assert piece["function"]["arguments"] == ""
            calls[index] = {
                "id": piece["id"],
                "type": piece["type"],
                "function": dict(piece["function"]),
            }
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[index]["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


async def test_auto_streams_text_then_the_call_as_deltas(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    _script(engine, tokenizer, "Let me check. " + CALL_TEXT)
    body = {"messages": USER, "max_tokens": 60, "tools": [WEATHER], "stream": True}
    events = parse_sse((await client.post(CHAT, json=body)).text)
    assert events[-1] == "[DONE]"
    deltas = [event["choices"][0] for event in events[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Let me check. "  # nothing of the call leaks as text
    pieces = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert len(pieces) > 2  # the name, then the arguments token by token
    (call,) = _streamed_calls(deltas)
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "Paris"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"
    whole = (await client.post(CHAT, json={**body, "stream": False})).json()["choices"][0]
    assert whole["message"]["content"] == "Let me check. "
    assert whole["message"]["tool_calls"][0]["function"] == call["function"]


async def test_auto_without_a_call_streams_plain_content(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    _script(engine, tokenizer, "It is <b>sunny</b> today.")
    body = {"messages": USER, "max_tokens": 60, "tools": [WEATHER], "stream": True}
    events = parse_sse((await client.post(CHAT, json=body)).text)
    deltas = [event["choices"][0] for event in events[:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "It is <b>sunny</b> today."
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert deltas[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_named_tool_choice_forces_the_arguments_schema(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer, stream: bool
) -> None:
    _script(engine, tokenizer, '{"city": "Rome"}')
    body: dict[str, Any] = {
        "messages": USER,
        "max_tokens": 30,
        "tools": [CLOCK, WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stream": stream,
    }
    response = await client.post(CHAT, json=body)
    spec = engine.requests[-1].sampling_params.structured_output
    assert spec == StructuredOutputSpec("json", json.dumps(SCHEMA))
    if stream:
        deltas = [e["choices"][0] for e in parse_sse(response.text)[:-1]]
        calls = _streamed_calls(deltas)
        finish_reason = deltas[-1]["finish_reason"]
    else:
        message = response.json()["choices"][0]["message"]
        calls = message["tool_calls"]
        finish_reason = response.json()["choices"][0]["finish_reason"]
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert finish_reason == "tool_calls"


async def test_required_forces_an_array_of_calls_to_known_tools(
    client: httpx.AsyncClient, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    _script(
        engine,
        tokenizer,
        '[{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    )
    body = {
        "messages": USER,
        "max_tokens": 60,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
    }
    choice = (await client.post(CHAT, json=body)).json()["choices"][0]
    schema = json.loads(engine.requests[-1].sampling_params.structured_output.value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_time",
        "get_weather",
    ]
    assert choice["finish_reason"] == "tool_calls"
    streamed = await client.post(CHAT, json={**body, "stream": True})
    deltas = [e["choices"][0] for e in parse_sse(streamed.text)[:-1]]
    calls = _streamed_calls(deltas)
    assert [c["function"] for c in calls] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in choice["message"]["tool_calls"]
    ]
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city": "Oslo"}']
    assert deltas[-1]["finish_reason"] == "tool_calls"
