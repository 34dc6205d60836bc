"""/v1/responses through the server's output parsing: each family's tool-call format, and
the thinking as a reasoning item, read by the official client whole and streamed.

The fake engine replays recorded-style generations (tests/gateway/tool_call_samples.py)
token by token, as in the chat path's own tests (test_gateway_tool_call_formats.py,
test_gateway_reasoning.py); here the same parsers must yield Responses output items.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseReasoningItem
from prometheus_client import CollectorRegistry

from kvmesh.gateway.engine.client import ModelInfo
from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.reasoning import REASONING_PARSERS
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from kvmesh.services.runtime.model_prep import default_model_path
from tests.family_templates import QWEN3
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME
from tests.gateway.tool_call_samples import MALFORMED, SAMPLES, TOOLS, Sample

# The chat samples' tools in the Responses shape (flat: type, name, parameters).
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
QUESTION = "Weather in Paris for 3 days, and the time in CET?"


def _engine(tokenizer: Tokenizer) -> FakeEngineClient:
    """Room for the tools in the prompt and a whole generation; special tokens kept as text
    only when a request asks for them (skip_special_tokens false)."""
    info = ModelInfo(
        served_model_name=MODEL_NAME,
        max_model_len=2048,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return FakeEngineClient(
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), info=info
    )


def _client(
    engine: FakeEngineClient, tokenizer: Tokenizer, parsing: OutputParsing
) -> openai.AsyncOpenAI:
    app = build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry(), output_parsing=parsing
    )
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
        max_retries=0,
    )


def _script(engine: FakeEngineClient, tokenizer: Tokenizer, text: str, eos: bool = True) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine.script = [*ids, tokenizer.eos_token_ids[0]] if eos else ids


async def _whole_and_streamed(
    client: openai.AsyncOpenAI, **kwargs: Any
) -> tuple[Response, Response, list[Any]]:
    """The response read whole, the streamed one (the last event's: completed or incomplete),
    and the stream's events as the client parsed them."""
    whole = await client.responses.create(model=MODEL_NAME, **kwargs)
    async with client.responses.stream(model=MODEL_NAME, **kwargs) as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    return whole, last.response, events


def _view(response: Response) -> dict[str, Any]:
    """What a client reads from a response: thinking, text and calls, without ids."""
    reasoning = [
        "".join(part.text for part in item.content or [])
        for item in response.output
        if item.type == "reasoning"
    ]
    calls = [
        (item.name, json.loads(item.arguments))
        for item in response.output
        if item.type == "function_call"
    ]
    return {
        "types": [item.type for item in response.output],
        "reasoning": reasoning,
        "text": response.output_text,
        "calls": calls,
        "status": response.status,
    }


# ---------------------------------------------------------------- tool-call formats


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngineClient:
    return _engine(tokenizer)


@pytest.fixture
async def format_clients(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    made = {
        name: _client(
            engine, tokenizer, OutputParsing(tool_parser=TOOL_PARSERS[name], auto_tool_choice=True)
        )
        for name in TOOL_PARSERS
    }
    yield made
    for client in made.values():
        await client.close()


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda sample: sample.id)
async def test_each_format_gives_function_call_items_whole_and_streamed(
    format_clients: dict[str, openai.AsyncOpenAI],
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    sample: Sample,
) -> None:
    _script(engine, tokenizer, sample.text)
    whole, streamed, events = await _whole_and_streamed(
        format_clients[sample.parser], input=QUESTION, tools=RESPONSE_TOOLS
    )
    expected_types = (["message"] if sample.content else []) + ["function_call"] * len(sample.calls)
    expected = {
        "types": expected_types,
        "reasoning": [],
        "text": sample.content or "",
        "calls": sample.calls,
        "status": "completed",
    }
    assert _view(whole) == _view(streamed) == expected
    # Each call's arguments streamed as deltas that add up to it, under its own item.
    for index, item in enumerate(streamed.output):
        if item.type == "function_call":
            deltas = [
                e.delta
                for e in events
                if e.type == "response.function_call_arguments.delta" and e.output_index == index
            ]
            assert "".join(deltas) == item.arguments
    assert len({item.call_id for item in whole.output if item.type == "function_call"}) == len(
        sample.calls
    )


@pytest.mark.parametrize(("parser", "text"), MALFORMED, ids=[f"{p}:{t[:20]}" for p, t in MALFORMED])
async def test_malformed_calls_come_back_as_text(
    format_clients: dict[str, openai.AsyncOpenAI],
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    parser: str,
    text: str,
) -> None:
    _script(engine, tokenizer, text)
    response = await format_clients[parser].responses.create(
        model=MODEL_NAME, input=QUESTION, tools=RESPONSE_TOOLS
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == tokenizer.decode(
        tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True
    )


async def test_auto_tool_choice_without_the_flag_is_refused_in_the_error_shape(
    openai_client_default: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client_default.responses.create(
            model=MODEL_NAME, input=QUESTION, tools=RESPONSE_TOOLS, tool_choice="auto"
        )
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["param"] == "tool_choice" and body["type"] == "invalid_request_error"
    assert "--enable-auto-tool-choice" in body["message"]


@pytest.mark.parametrize("streamed", [False, True])
async def test_tools_left_to_the_default_choice_without_the_flag_are_answered_in_text(
    openai_client_default: openai.AsyncOpenAI,
    engine: FakeEngineClient,
    tokenizer: Tokenizer,
    streamed: bool,
) -> None:
    """As vLLM's Responses API: the tools are in the prompt, no call is parsed out of the text."""
    hermes = next(sample for sample in SAMPLES if sample.parser == "hermes")
    _script(engine, tokenizer, hermes.text)
    if streamed:
        async with openai_client_default.responses.stream(
            model=MODEL_NAME, input=QUESTION, tools=RESPONSE_TOOLS
        ) as stream:
            response = await stream.get_final_response()
    else:
        response = await openai_client_default.responses.create(
            model=MODEL_NAME, input=QUESTION, tools=RESPONSE_TOOLS
        )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == hermes.text
    prompt = tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "get_weather" in prompt and "get_time" in prompt


@pytest.fixture
async def openai_client_default(
    engine: FakeEngineClient, tokenizer: Tokenizer
) -> AsyncIterator[openai.AsyncOpenAI]:
    """A server with no output parsing flags."""
    client = _client(engine, tokenizer, OutputParsing())
    yield client
    await client.close()


# ---------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The default model's vocabulary under a Qwen3-style chat template."""
    fresh = Tokenizer.from_pretrained(default_model_path())
    fresh._hf.chat_template = QWEN3
    return fresh


@pytest.fixture
def qwen3_engine(qwen3_tokenizer: Tokenizer) -> FakeEngineClient:
    return _engine(qwen3_tokenizer)


@pytest.fixture
async def reasoning_clients(
    qwen3_engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    made = {
        name: _client(
            qwen3_engine,
            qwen3_tokenizer,
            OutputParsing(
                reasoning=REASONING_PARSERS[name],
                tool_parser=TOOL_PARSERS["hermes"],
                auto_tool_choice=True,
            ),
        )
        for name in REASONING_PARSERS
    }
    yield made
    for client in made.values():
        await client.close()


@pytest.mark.parametrize(
    ("parser", "text", "thinking", "answer"),
    [
        (
            "qwen3",
            "<think>\nTwo and two.\n</think>\n\nIt is 4.",
            "\nTwo and two.\n",
            "\n\nIt is 4.",
        ),
        (
            "deepseek_r1",
            "Two and two make four.\n</think>It is 4.",
            "Two and two make four.\n",
            "It is 4.",
        ),
        ("mistral", "[THINK]Two and two.[/THINK]It is 4.", "Two and two.", "It is 4."),
    ],
)
async def test_thinking_is_a_reasoning_item_whole_and_streamed(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
    parser: str,
    text: str,
    thinking: str,
    answer: str,
) -> None:
    _script(qwen3_engine, qwen3_tokenizer, text)
    whole, streamed, events = await _whole_and_streamed(
        reasoning_clients[parser], input="What is 2 + 2?"
    )
    expected = {
        "types": ["reasoning", "message"],
        "reasoning": [thinking],
        "text": answer,
        "calls": [],
        "status": "completed",
    }
    assert _view(whole) == _view(streamed) == expected
    item = whole.output[0]
    assert isinstance(item, ResponseReasoningItem)
    assert item.summary == [] and item.status == "completed"
    # The client parsed the typed reasoning events; their deltas add up to the done text.
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done.text == thinking
    assert all(
        e.output_index == 0 and e.content_index == 0
        for e in events
        if e.type.startswith("response.reasoning_text")
    )
    kinds = [e.type for e in events if e.type.endswith(".delta")]
    assert kinds == sorted(
        kinds, key=["response.reasoning_text.delta", "response.output_text.delta"].index
    )


async def test_a_call_after_the_thinking_is_a_function_call_item(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
) -> None:
    thinking_call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>?'
    _script(
        qwen3_engine,
        qwen3_tokenizer,
        f"<think>{thinking_call}</think>"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )
    whole, streamed, _ = await _whole_and_streamed(
        reasoning_clients["qwen3"], input=QUESTION, tools=RESPONSE_TOOLS
    )
    expected = {
        "types": ["reasoning", "function_call"],
        "reasoning": [thinking_call],  # a call written while thinking is not a call
        "text": "",
        "calls": [("get_weather", {"city": "Paris"})],
        "status": "completed",
    }
    assert _view(whole) == _view(streamed) == expected


async def test_thinking_cut_short_is_an_incomplete_reasoning_item(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
) -> None:
    _script(qwen3_engine, qwen3_tokenizer, "<think>Let me count: one, two, three", eos=False)
    whole, streamed, _ = await _whole_and_streamed(
        reasoning_clients["qwen3"], input="Count", max_output_tokens=6
    )
    assert _view(whole) == _view(streamed)
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["reasoning"]
    assert whole.output[0].status == "incomplete"


async def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
) -> None:
    client = reasoning_clients["qwen3"]
    _script(qwen3_engine, qwen3_tokenizer, "It is 4.")
    response = await client.responses.create(
        model=MODEL_NAME, input="2 + 2?", reasoning={"effort": "none"}
    )
    prompt = qwen3_tokenizer.decode(qwen3_engine.requests[-1].prompt_token_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # the template closed the thinking
    assert _view(response)["types"] == ["message"] and response.output_text == "It is 4."
    assert response.reasoning is not None and response.reasoning.effort == "none"
    # Any other effort leaves the thinking on: the same text is the model's thinking.
    response = await client.responses.create(
        model=MODEL_NAME, input="2 + 2?", reasoning={"effort": "low"}
    )
    assert _view(response)["types"] == ["reasoning"]


async def test_text_format_waits_for_the_end_of_the_thinking(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
) -> None:
    end = tuple(qwen3_tokenizer.encode("</think>", add_special_tokens=False))
    _script(qwen3_engine, qwen3_tokenizer, '<think>Paris.</think>{"city": "Paris"}')
    text_format = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}
    response = await reasoning_clients["qwen3"].responses.create(
        model=MODEL_NAME, input="Where?", text=text_format
    )
    spec = qwen3_engine.requests[-1].sampling_params.structured_output
    assert spec is not None and spec.reasoning_end_token_ids == end
    assert _view(response)["reasoning"] == ["Paris."]
    assert json.loads(response.output_text) == {"city": "Paris"}


async def test_reasoning_items_sent_back_as_input_are_accepted(
    reasoning_clients: dict[str, openai.AsyncOpenAI],
    qwen3_engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
) -> None:
    """As OpenAI's guide and vLLM's example do: the previous output goes back as input."""
    client = reasoning_clients["qwen3"]
    _script(qwen3_engine, qwen3_tokenizer, "<think>Two and two.</think>It is 4.")
    first = await client.responses.create(model=MODEL_NAME, input="2 + 2?", store=False)
    history = [{"role": "user", "content": "2 + 2?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"role": "user", "content": "And 3 + 3?"})
    second = await client.responses.create(model=MODEL_NAME, input=history)
    assert second.status == "completed"
    prompt = qwen3_tokenizer.decode(qwen3_engine.requests[-1].prompt_token_ids)
    assert prompt.index("It is 4.") < prompt.index("And 3 + 3?")


async def test_reasoning_items_alone_are_a_400_naming_input(
    openai_client_default: openai.AsyncOpenAI,
) -> None:
    reasoning = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hmm"}],
    }
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client_default.responses.create(model=MODEL_NAME, input=[reasoning])
    assert raised.value.body["param"] == "input"  # type: ignore[index]
