"""Structured outputs and tool calls through the official openai client, on the real stack."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
        "year": {"type": "integer"},
    },
    "required": ["city", "year"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", timeout=120)


def test_json_schema_output_parses_and_validates(client) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name a European capital and a year, as JSON."}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CITY)


def test_choice_regex_and_grammar_hold_streaming_and_not(client) -> None:
    prompt = "Is the sky blue? Answer:"
    choice = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert choice.choices[0].text in ("yes", "no", "maybe")
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Today's date is",
        max_tokens=16,
        temperature=0.8,
        seed=3,
        stream=True,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", text), text
    grammar = 'root ::= "The answer is " digit digit\ndigit ::= [0-9]'
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch(r"The answer is [0-9]{2}", out.choices[0].text)


def test_bad_constraints_are_400_early_or_from_the_worker(client) -> None:
    with pytest.raises(openai.BadRequestError) as early:
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="x", extra_body={"guided_json": "{not json"}
        )
    assert early.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError) as compiled:
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="x", extra_body={"guided_regex": "(unclosed"}
        )
    assert "regex" in compiled.value.body["message"]


def test_named_tool_choice_returns_valid_arguments(client) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=32,
        temperature=0,
    )
    choice = response.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert choice.finish_reason == "tool_calls"


def test_required_tool_choice_streams_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    pieces = []
    finish_reason = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        pieces.extend(delta.tool_calls or [])
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert pieces and finish_reason == "tool_calls"
    # As OpenAI streams them: each call's id and name first, then argument fragments.
    calls: dict[int, dict[str, str]] = {}
    for piece in pieces:
        if piece.index not in calls:
            assert piece.id and piece.function.name and piece.function.arguments == ""
            calls[piece.index] = {"name": piece.function.name, "arguments": ""}
        else:
            assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments
    assert len(pieces) > len(calls) + 1  # the arguments came in several fragments
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_auto_parses_a_hermes_call_from_the_text(client) -> None:
    # The tiny model rarely calls tools on its own; a regex makes it write one.
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"(Paris|Rome)"}}</tool_call>'
    pattern = re.escape(call).replace(re.escape("(Paris|Rome)"), "(Paris|Rome)")
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Par'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "error: bad arguments"},
    ]
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=history,
        tools=[WEATHER],
        max_tokens=32,
        temperature=0,
        extra_body={"guided_regex": pattern},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (parsed,) = choice.message.tool_calls
    assert parsed.function.name == "get_weather"
    assert json.loads(parsed.function.arguments)["city"] in ("Paris", "Rome")
