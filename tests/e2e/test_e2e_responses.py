"""/v1/responses on the real stack: the OpenAI Agents SDK and the plain openai client.

The default model is too small to call tools on its own, so the agent forces
its tool by name on the first turn (the Agents SDK then resets tool_choice, and
the second turn answers in text after the tool's result).
"""

from __future__ import annotations

import json

import agents
import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
CITIES = ["Paris", "Rome"]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}},
    "required": ["city"],
    "additionalProperties": False,
}


def recording_client(stack, sent: list[dict]) -> openai.AsyncOpenAI:
    """An async client that appends each JSON body it posts to /v1/responses to ``sent``.

    Made inside the test, not by a fixture: its connections belong to the test's loop.
    """

    async def record(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/v1/responses"):
            sent.append(json.loads(request.content))

    http_client = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    return openai.AsyncOpenAI(
        base_url=stack.http_url + "/v1", api_key="unused", http_client=http_client
    )


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", timeout=120)


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_runs_a_function_tool_through_responses(stack, streamed: bool) -> None:
    agents.set_tracing_disabled(True)
    sent: list[dict] = []
    async_client = recording_client(stack, sent)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city (Paris or Rome)."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather in one sentence.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=async_client),
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", temperature=0, max_tokens=40
        ),
    )
    question = "What is the weather in Paris?"
    async with async_client:
        if streamed:
            run = agents.Runner.run_streamed(agent, question, auto_previous_response_id=True)
            kinds = [event.type async for event in run.stream_events()]
            assert "raw_response_event" in kinds
            result: agents.RunResult | agents.RunResultStreaming = run
        else:
            result = await agents.Runner.run(agent, question, auto_previous_response_id=True)
    assert len(calls) == 1 and calls[0]  # the forced turn produced a call the SDK could run
    assert isinstance(result.final_output, str) and result.final_output.strip()
    first, second = sent[:2]
    assert first["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert first.get("stream", False) is streamed
    # The next turn carries only the tool's result, chained by previous_response_id.
    assert second["previous_response_id"].startswith("resp_")
    (call_output,) = second["input"]
    assert call_output["type"] == "function_call_output"
    assert call_output["output"] == f"It is sunny and 21 degrees in {calls[0]}."


def test_responses_create_and_retrieve(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Write one sentence about the sea.",
        instructions="Be brief.",
        max_output_tokens=24,
        temperature=0,
    )
    assert response.status in ("completed", "incomplete")
    assert response.output_text.strip()
    assert response.usage is not None and 0 < response.usage.output_tokens <= 24
    assert client.responses.retrieve(response.id).output_text == response.output_text
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input="Now one about the sky.",
        max_output_tokens=16,
        temperature=0,
    )
    # The follow-up's prompt holds the first turn: its input is larger by at least it.
    assert follow_up.usage is not None
    assert follow_up.usage.input_tokens > response.usage.input_tokens
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_responses_stream_adds_up_to_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input="Name three colours.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    assert events[0].type == "response.created"
    # The client's get_final_response() wants response.completed; an answer cut
    # by max_output_tokens ends with response.incomplete, which carries it too.
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    # Greedy decoding: the same request unstreamed says the same.
    whole = client.responses.create(
        model=MODEL, input="Name three colours.", max_output_tokens=12, temperature=0
    )
    assert whole.output_text == text


def test_text_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Pick a city for a holiday, as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=32,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)


def test_forced_function_call_streams_argument_deltas(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    stream = client.responses.create(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=48,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    completed = events[-1]
    assert completed.type == "response.completed"
    (call,) = completed.response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_bad_input_is_a_400_in_the_error_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hi", tool_choice="required")
    assert raised.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=100_000)
    assert raised.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_none")
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
