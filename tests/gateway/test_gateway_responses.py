"""/v1/responses through the official openai client and the Agents SDK, with the fake engine.

The fake engine echoes the prompt, or plays ``engine.script``: a forced call's
arguments followed by EOS is what the grammar makes a real model write.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import agents
import httpx
import openai
import pytest
from fastapi import FastAPI

from kvmesh.gateway.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
ARGUMENTS = '{"city": "Paris"}'


@pytest.fixture
def sent() -> list[dict]:
    """The JSON bodies the client posted to /v1/responses, in order."""
    return []


@pytest.fixture
async def openai_client(app: FastAPI, sent: list[dict]) -> AsyncIterator[openai.AsyncOpenAI]:
    async def record(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path == "/v1/responses":
            sent.append(json.loads(request.content))

    http_client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), event_hooks={"request": [record]}
    )
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="unused", http_client=http_client, max_retries=0
    )
    yield client
    await client.close()


def script(engine: FakeEngineClient, tokenizer: Tokenizer, text: str) -> None:
    """Every request generates ``text`` and then EOS (finish reason "stop")."""
    engine.script = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]


def prompt_text(engine: FakeEngineClient, tokenizer: Tokenizer, index: int = -1) -> str:
    return tokenizer.decode(engine.requests[index].prompt_token_ids)


async def test_text_response_has_the_output_usage_and_echoed_settings(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, "Hello back")
    response = await openai_client.responses.create(
        model=MODEL_NAME,
        input="Hello",
        instructions="Answer briefly.",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=20,
        metadata={"k": "v"},
    )
    assert response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.output_text == "Hello back"
    assert response.instructions == "Answer briefly."
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 20)
    assert response.metadata == {"k": "v"}
    assert response.usage is not None
    assert response.usage.output_tokens == len(engine.script or [])
    request = engine.requests[0]
    assert response.usage.input_tokens == len(request.prompt_token_ids)
    assert request.sampling_params.temperature == 0.5
    assert request.sampling_params.top_p == 0.9
    assert request.sampling_params.max_tokens == 20
    prompt = prompt_text(engine, tokenizer)
    assert prompt.index("Answer briefly.") < prompt.index("Hello")


async def test_max_output_tokens_leaves_the_response_incomplete(
    openai_client: openai.AsyncOpenAI,
) -> None:
    response = await openai_client.responses.create(
        model=MODEL_NAME, input="Tell me a long story", max_output_tokens=3
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"


async def test_forced_function_call_is_constrained_and_returned_as_an_item(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, ARGUMENTS)
    response = await openai_client.responses.create(
        model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCE_WEATHER
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"
    constraint = engine.requests[0].sampling_params.structured_output
    assert constraint is not None and json.loads(constraint.value) == WEATHER["parameters"]
    assert response.tools[0].name == "get_weather"


async def test_text_format_json_schema_becomes_the_constraint(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = await openai_client.responses.create(
        model=MODEL_NAME,
        input="A number as JSON",
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    assert json.loads(response.output_text) == {"a": 1}
    constraint = engine.requests[0].sampling_params.structured_output
    assert constraint is not None and constraint.kind == "json"
    assert json.loads(constraint.value) == schema
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


async def test_a_forced_call_wins_over_text_format(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, ARGUMENTS)
    response = await openai_client.responses.create(
        model=MODEL_NAME,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        text={"format": {"type": "json_object"}},
    )
    constraint = engine.requests[0].sampling_params.structured_output
    assert constraint is not None and json.loads(constraint.value)["type"] == "array"
    assert response.status == "completed"


async def test_previous_response_id_continues_with_the_tool_result(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, ARGUMENTS)
    first = await openai_client.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        instructions="Be a weather bot.",
        tools=[WEATHER],
        tool_choice=FORCE_WEATHER,
    )
    (call,) = first.output
    assert call.type == "function_call"
    script(engine, tokenizer, "It is sunny.")
    second = await openai_client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}],
        tools=[WEATHER],
    )
    assert second.previous_response_id == first.id
    assert second.output_text == "It is sunny."
    prompt = prompt_text(engine, tokenizer)
    # The first turn's question and call, then the result; instructions are not carried over.
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert prompt.index("Weather in Paris?") < prompt.index(call_text) < prompt.index("sunny, 21C")
    assert "Be a weather bot." not in prompt
    third = await openai_client.responses.create(
        model=MODEL_NAME, previous_response_id=second.id, input="And tomorrow?"
    )
    prompt = prompt_text(engine, tokenizer)
    assert prompt.index("sunny, 21C") < prompt.index("It is sunny.") < prompt.index("And tomorrow")
    assert third.status == "completed"


async def test_history_sent_as_input_items_renders_like_the_stored_one(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    """Without previous_response_id the client sends the items back itself (store false)."""
    script(engine, tokenizer, ARGUMENTS)
    first = await openai_client.responses.create(
        model=MODEL_NAME, input="Weather?", tools=[WEATHER], tool_choice=FORCE_WEATHER, store=False
    )
    (call,) = first.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
    chained_input = [
        {"role": "user", "content": "Weather?"},
        call.model_dump(exclude_none=True),
        result,
    ]
    await openai_client.responses.create(model=MODEL_NAME, input=chained_input, tools=[WEATHER])
    prompt = prompt_text(engine, tokenizer)
    assert prompt.index("Weather?") < prompt.index('{"city": "Paris"}}') < prompt.index("rain")
    with pytest.raises(openai.NotFoundError):
        await openai_client.responses.retrieve(first.id)


async def test_stream_events_add_up_to_the_final_response(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, "Sunny all day")
    async with openai_client.responses.stream(model=MODEL_NAME, input="Weather?") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == "Sunny all day"
    assert final.status == "completed" and final.usage is not None
    stored = await openai_client.responses.retrieve(final.id)
    assert stored.output_text == "Sunny all day"


async def test_stream_of_a_forced_call_sends_argument_deltas(
    openai_client: openai.AsyncOpenAI, engine: FakeEngineClient, tokenizer: Tokenizer
) -> None:
    script(engine, tokenizer, ARGUMENTS)
    stream = await openai_client.responses.create(
        model=MODEL_NAME, input="Weather?", tools=[WEATHER], tool_choice=FORCE_WEATHER, stream=True
    )
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert "response.function_call_arguments.delta" in types
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == ARGUMENTS
    completed = events[-1]
    assert completed.type == "response.completed"
    (call,) = completed.response.output
    assert call.type == "function_call" and call.arguments == ARGUMENTS
    assert call.call_id == added.item.call_id


async def test_a_generation_failing_midstream_sends_error_and_failed(
    client: httpx.AsyncClient, engine: FakeEngineClient
) -> None:
    engine.fail_after_deltas = 2
    response = await client.post(
        "/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "stream": True}
    )
    assert response.status_code == 200
    blocks = [block for block in response.text.strip().split("\n\n")]
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
    assert [block.split("\n")[0] for block in blocks] == [
        f"event: {event['type']}" for event in events
    ]
    assert events[-2]["type"] == "error" and events[-2]["code"] == "server_error"
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "worker died"


async def test_get_and_delete_stored_responses(
    openai_client: openai.AsyncOpenAI, client: httpx.AsyncClient
) -> None:
    response = await openai_client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=2
    )
    fetched = await openai_client.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump()
    deleted = await client.delete(f"/v1/responses/{response.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        again = await client.request(method, f"/v1/responses/{response.id}")
        assert again.status_code == 404
        assert again.json()["error"]["param"] == "response_id"
    not_kept = await openai_client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        await openai_client.responses.retrieve(not_kept.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "model": "other"}, "model"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    client: httpx.AsyncClient, body: dict, param: str
) -> None:
    response = await client.post("/v1/responses", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error


async def test_unknown_previous_response_is_a_404_naming_it(
    openai_client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await openai_client.responses.create(
            model=MODEL_NAME, input="Hi", previous_response_id="resp_gone"
        )
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize("streamed", [False, True])
async def test_agents_sdk_runs_a_tool_and_chains_by_previous_response_id(
    openai_client: openai.AsyncOpenAI,
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    sent: list[dict],
    streamed: bool,
) -> None:
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=openai_client),
        model_settings=agents.ModelSettings(tool_choice="get_weather"),
    )
    # The forced first turn writes the arguments; the second turn (tool_choice
    # left out, on a server that parses no calls from text) writes the same
    # text, which is the answer.
    script(engine, tokenizer, ARGUMENTS)
    if streamed:
        run = agents.Runner.run_streamed(agent, "Weather in Paris?", auto_previous_response_id=True)
        async for _ in run.stream_events():
            pass
        result: agents.RunResult | agents.RunResultStreaming = run
    else:
        result = await agents.Runner.run(agent, "Weather in Paris?", auto_previous_response_id=True)
    assert calls == ["Paris"]
    assert result.final_output == ARGUMENTS
    first, second = engine.requests
    assert first.sampling_params.structured_output is not None  # the forced call
    assert second.sampling_params.structured_output is None
    # The second turn sent only the tool's output and chained the first by id,
    # and the gateway put the stored turn back in front of it.
    first_body, second_body = sent
    assert first_body["tool_choice"] == FORCE_WEATHER
    assert first_body.get("stream", False) is streamed
    (call_output,) = second_body["input"]
    assert call_output["type"] == "function_call_output"
    assert call_output["output"] == "sunny in Paris"
    first_id = second_body["previous_response_id"]
    prompt = tokenizer.decode(second.prompt_token_ids)
    assert prompt.index("Weather in Paris?") < prompt.index("sunny in Paris")
    assert result.last_response_id not in (None, first_id)
