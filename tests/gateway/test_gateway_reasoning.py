"""--reasoning-parser: thinking comes back as reasoning_content, whole and streamed, and
only the answer after it is read for tool calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
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
from tests.gateway.tool_call_samples import TOOLS

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The default model's vocabulary under a Qwen3-style chat template."""
    fresh = Tokenizer.from_pretrained(default_model_path())
    fresh._hf.chat_template = QWEN3
    return fresh


@pytest.fixture
def engine(qwen3_tokenizer: Tokenizer) -> FakeEngineClient:
    info = ModelInfo(
        served_model_name=MODEL_NAME,
        max_model_len=2048,
        vocab_size=qwen3_tokenizer.vocab_size,
        eos_token_ids=qwen3_tokenizer.eos_token_ids,
    )
    return FakeEngineClient(
        decode=lambda ids: qwen3_tokenizer.decode(ids, skip_special_tokens=True), info=info
    )


def _client(engine: FakeEngineClient, tokenizer: Tokenizer, reasoning: str) -> openai.AsyncOpenAI:
    parsing = OutputParsing(
        reasoning=REASONING_PARSERS[reasoning],
        tool_parser=TOOL_PARSERS["hermes"],
        auto_tool_choice=True,
    )
    app = build_app(
        engine, tokenizer, MODEL_NAME, metrics_registry=CollectorRegistry(), output_parsing=parsing
    )
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
        max_retries=0,
    )


@pytest.fixture
async def clients(
    engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    made = {name: _client(engine, qwen3_tokenizer, name) for name in REASONING_PARSERS}
    yield made
    for client in made.values():
        await client.close()


def _script(engine: FakeEngineClient, tokenizer: Tokenizer, text: str, eos: bool = True) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine.script = [*ids, tokenizer.eos_token_id] if eos else ids


async def _both(
    client: openai.AsyncOpenAI, **kwargs: object
) -> tuple[dict[str, object], dict[str, object]]:
    """(whole message, streamed message assembled from its deltas) as plain dicts."""
    whole = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, **kwargs)
    message = whole.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    whole_view = {
        "reasoning": getattr(message, "reasoning_content", None),
        "content": message.content,
        "calls": calls,
        "finish": whole.choices[0].finish_reason,
    }
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, stream=True, **kwargs
    )
    reasoning, content, arguments, names, finish = "", "", {}, {}, None
    order: list[str] = []  # which kind of delta came, in order
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            piece = getattr(delta, "reasoning_content", None)
            if piece:
                reasoning += piece
                order.append("reasoning")
            if delta.content:
                content += delta.content
                order.append("content")
            for call in delta.tool_calls or []:
                order.append("call")
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or "" if call.function else ""
                )
            finish = choice.finish_reason or finish
    assert order == sorted(order, key=["reasoning", "content", "call"].index), order
    streamed_view = {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [(names[i], json.loads(arguments[i])) for i in sorted(names)],
        "finish": finish,
    }
    return whole_view, streamed_view


THINK_THEN_CALL = (
    '<think>\nThe user wants the weather.\n</think>\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (
            "qwen3",
            "<think>\nTwo and two.\n</think>\n\nIt is 4.",
            {"reasoning": "\nTwo and two.\n", "content": "\n\nIt is 4.", "finish": "stop"},
        ),
        (
            "deepseek_r1",  # R1 distills think without writing <think> first
            "Two and two make four.\n</think>\n\nIt is 4.",
            {"reasoning": "Two and two make four.\n", "content": "\n\nIt is 4.", "finish": "stop"},
        ),
        (
            "mistral",
            "[THINK]Two and two.[/THINK]It is 4.",
            {"reasoning": "Two and two.", "content": "It is 4.", "finish": "stop"},
        ),
        (
            "mistral",  # Magistral thinks only after [THINK]
            "It is 4.",
            {"reasoning": None, "content": "It is 4.", "finish": "stop"},
        ),
    ],
)
async def test_thinking_is_reasoning_content_whole_and_streamed(
    clients: dict[str, openai.AsyncOpenAI],
    engine: FakeEngineClient,
    qwen3_tokenizer: Tokenizer,
    parser: str,
    text: str,
    expected: dict[str, object],
) -> None:
    _script(engine, qwen3_tokenizer, text)
    whole, streamed = await _both(clients[parser])
    assert whole == streamed == {**expected, "calls": []}


async def test_calls_are_read_from_the_answer_after_the_thinking(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen3_tokenizer, THINK_THEN_CALL)
    whole, streamed = await _both(clients["qwen3"], tools=TOOLS)
    assert whole == streamed
    assert whole["reasoning"] == "\nThe user wants the weather.\n"
    assert whole["content"] == "\n"
    assert whole["calls"] == [("get_weather", {"city": "Paris"})]
    assert whole["finish"] == "tool_calls"


async def test_a_call_written_inside_the_thinking_is_not_a_call(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    thinking = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> maybe?'
    _script(engine, qwen3_tokenizer, f"<think>{thinking}</think>No call needed.")
    whole, streamed = await _both(clients["qwen3"], tools=TOOLS)
    assert whole == streamed
    assert whole["reasoning"] == thinking and whole["content"] == "No call needed."
    assert whole["calls"] == [] and whole["finish"] == "stop"


async def test_cut_short_thinking_is_all_reasoning(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen3_tokenizer, "<think>Let me count: one, two, three", eos=False)
    whole, streamed = await _both(clients["qwen3"], max_tokens=6)
    assert whole == streamed
    assert whole["content"] is None and whole["finish"] == "length"
    assert isinstance(whole["reasoning"], str) and whole["reasoning"].startswith("Let me")


async def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen3_tokenizer, "It is 4.")
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    whole, streamed = await _both(clients["qwen3"], **kwargs)
    assert (
        whole
        == streamed
        == {"reasoning": None, "content": "It is 4.", "calls": [], "finish": "stop"}
    )
    prompt = qwen3_tokenizer.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # the template closed the thinking
    # By default the same output is thinking (Qwen3 thinks unless told not to).
    whole, _ = await _both(clients["qwen3"])
    assert whole["reasoning"] == "It is 4." and whole["content"] is None


async def test_without_a_reasoning_parser_thinking_stays_in_the_content(
    client: httpx.AsyncClient, engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen3_tokenizer, "<think>hmm</think>4")
    body = {"messages": ASK, "max_tokens": 20}
    message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message["content"] == "<think>hmm</think>4"
    assert message["reasoning_content"] is None


async def test_structured_output_and_forced_calls_wait_for_the_end_of_the_thinking(
    clients: dict[str, openai.AsyncOpenAI], engine: FakeEngineClient, qwen3_tokenizer: Tokenizer
) -> None:
    end = tuple(qwen3_tokenizer.encode("</think>", add_special_tokens=False))
    client = clients["qwen3"]
    _script(engine, qwen3_tokenizer, '<think>Paris, surely.</think>{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed = await _both(client, tools=TOOLS, tool_choice=named)
    assert whole == streamed
    assert whole["reasoning"] == "Paris, surely." and whole["content"] is None
    assert whole["calls"] == [("get_weather", {"city": "Paris"})]
    spec = engine.requests[-1].sampling_params.structured_output
    assert spec is not None and spec.reasoning_end_token_ids == end
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    await client.chat.completions.create(model=MODEL_NAME, messages=ASK, response_format=schema)
    spec = engine.requests[-1].sampling_params.structured_output
    assert spec is not None and spec.kind == "json" and spec.reasoning_end_token_ids == end
    # Thinking switched off in the template: the grammar applies from the first token.
    await client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        response_format=schema,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    spec = engine.requests[-1].sampling_params.structured_output
    assert spec is not None and spec.reasoning_end_token_ids == ()
    # Magistral thinks only if it opens with [THINK]: no gate to wait for.
    await clients["mistral"].chat.completions.create(
        model=MODEL_NAME, messages=ASK, response_format=schema
    )
    assert engine.requests[-1].sampling_params.structured_output.reasoning_end_token_ids == ()
