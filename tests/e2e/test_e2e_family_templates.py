"""The whole stack serving a tiny random Llama whose chat template is a family's.

What this proves, honestly: random weights never write tool syntax or close
their thinking on their own, so these tests (1) check that the family's
template reaches the prompt (tools rendered, ``enable_thinking`` honoured),
that the server picked the family's parser from the template and logged it,
(2) drive a call in the family's format end to end by forcing the text with
a regex (the structured-output path), so the real detokenizer's deltas go
through the parser, whole and streamed, to the OpenAI client, and (3) check
that with thinking on, everything generated is reasoning and a constraint
waits for the end of the thinking instead of shaping it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from kvmesh.services.cli.local_stack import LocalStack
from kvmesh.services.runtime.model_prep import default_model_path, is_prepared
from tests.e2e.conftest import STARTUP_TIMEOUT_S
from tests.family_templates import FAMILY_TEMPLATES, LLAMA3_JSON, QWEN3
from tests.worker.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MODEL = "tiny"


def _tiny_family_checkpoint(folder: Path, template: str) -> Path:
    """A random 2-layer Llama with the default model's vocabulary, under ``template``."""
    source = default_model_path()
    if not is_prepared(source):
        pytest.skip("default model not prepared (run `make install`)")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    make_tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        torch.float32,
        vocab_size=vocab,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def _start(folder: Path, *flags: str) -> LocalStack:
    stack = LocalStack(
        ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256", *flags],
        model=folder,
    )
    stack.wait_ready(STARTUP_TIMEOUT_S)
    return stack


@pytest.fixture(scope="module")
def qwen3_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    folder = _tiny_family_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), QWEN3)
    stack = _start(
        folder,
        "--served-model-name",
        MODEL,
        "--enable-auto-tool-choice",
        "--reasoning-parser",
        "qwen3",
    )
    yield stack, folder
    assert stack.stop() == 0, "".join(stack.log[-50:])


@pytest.fixture(scope="module")
def llama3_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    folder = _tiny_family_checkpoint(tmp_path_factory.mktemp("tiny-llama3"), LLAMA3_JSON)
    stack = _start(folder, "--served-model-name", MODEL, "--enable-auto-tool-choice")
    yield stack
    assert stack.stop() == 0, "".join(stack.log[-50:])


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", timeout=120)


def _forced(call_text: str) -> str:
    """A regex that matches exactly ``call_text``, except that the city is Paris or Rome."""
    return re.escape(call_text).replace("Paris", "(Paris|Rome)")


def _streamed_calls(stream: object) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, names, arguments, finish = "", {}, {}, None
    for chunk in stream:  # type: ignore[attr-defined]
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
            finish = choice.finish_reason or finish
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    return content, calls, finish


def test_the_parser_comes_from_the_template_and_the_template_gets_tools_and_kwargs(
    qwen3_stack: tuple[LocalStack, Path],
) -> None:
    stack, _ = qwen3_stack
    assert any("tool-call parser from the chat template: hermes" in line for line in stack.log)
    client = _client(stack)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    # tool_choice none renders no tools; auto does, through the family's own template.
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    no_thinking = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # The template wrote "<think>\n\n</think>\n\n" after the generation prompt.
    assert no_thinking.usage.prompt_tokens > plain.usage.prompt_tokens


def test_thinking_is_reasoning_content_and_a_constraint_waits_for_its_end(
    qwen3_stack: tuple[LocalStack, Path],
) -> None:
    stack, folder = qwen3_stack
    client = _client(stack)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)  # as the gateway encodes it
    free = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0)
    text = free.choices[0].text
    # The qwen3 parser's rule: an opening <think> is dropped, </think> ends the thinking.
    body = text.lstrip()[len("<think>") :] if text.lstrip().startswith("<think>") else text
    reasoning, _, content = body.partition("</think>")
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    message = chat.choices[0].message
    assert message.reasoning_content == reasoning  # type: ignore[attr-defined]
    assert message.content == (content or None)
    # A JSON constraint does not shape the thinking: the same free tokens come out.
    constrained = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert constrained.choices[0].message.reasoning_content == reasoning  # type: ignore[attr-defined]


def test_a_hermes_call_in_the_answer_is_parsed_whole_and_streamed(
    qwen3_stack: tuple[LocalStack, Path],
) -> None:
    stack, _ = qwen3_stack
    client = _client(stack)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "max_tokens": 240,
        "temperature": 0,
        # Thinking off, so the grammar applies from the first token and writes the call.
        "extra_body": {
            "guided_regex": _forced(call),
            "chat_template_kwargs": {"enable_thinking": False},
        },
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    (parsed,) = whole.message.tool_calls
    assert parsed.function.name == "get_weather"
    assert json.loads(parsed.function.arguments)["city"] in ("Paris", "Rome")
    assert whole.message.content is None
    content, calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert calls == [("get_weather", json.loads(parsed.function.arguments))]


def test_a_llama3_json_pair_of_calls_is_parsed_whole_and_streamed(llama3_stack: LocalStack) -> None:
    assert any(
        "tool-call parser from the chat template: llama3_json" in line for line in llama3_stack.log
    )
    client = _client(llama3_stack)
    calls_text = (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "max_tokens": 400,
        "temperature": 0,
        "extra_body": {"guided_regex": _forced(calls_text)},
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    parsed = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert [name for name, _ in parsed] == ["get_weather", "get_weather"]
    assert all(arguments["city"] in ("Paris", "Rome") for _, arguments in parsed)
    assert len({c.id for c in whole.message.tool_calls}) == 2
    content, calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == "" and calls == parsed


def test_responses_carry_the_thinking_as_a_reasoning_item(
    qwen3_stack: tuple[LocalStack, Path],
) -> None:
    """/v1/responses reads the output with the same parser: the greedy thinking chat returns
    as reasoning_content is the response's reasoning item, whole and streamed."""
    stack, _ = qwen3_stack
    client = _client(stack)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    message = chat.choices[0].message
    reasoning = message.reasoning_content  # type: ignore[attr-defined]
    kwargs = {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)  # type: ignore[arg-type]
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        events = list(stream)
    streamed = events[-1].response  # type: ignore[union-attr]
    for response in (whole, streamed):
        thinking = [
            "".join(part.text for part in item.content or [])
            for item in response.output
            if item.type == "reasoning"
        ]
        assert thinking == ([reasoning] if reasoning else [])
        assert response.output_text == (message.content or "")
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == (reasoning or "")
    # reasoning.effort "none" reaches the template as enable_thinking false: no thinking.
    off = client.responses.create(**kwargs, reasoning={"effort": "none"})  # type: ignore[arg-type]
    assert [item.type for item in off.output] == ["message"]


# Two parallel calls in each remaining family's format, as its model writes them
# (tests/gateway/test_gateway_tool_call_formats.py has the recorded-style samples;
# here the text is forced so that the real detokenizer's deltas carry it).
PARALLEL_CALLS = {
    "pythonic": '[get_weather(city="Paris"), get_weather(city="Paris")]',
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ),
    "qwen3_coder": (
        "<tool_call><function=get_weather><parameter=city>Paris</parameter></function>"
        "</tool_call><tool_call><function=get_weather><parameter=city>Paris</parameter>"
        "</function></tool_call>"
    ),
}


@pytest.mark.parametrize("family", sorted(PARALLEL_CALLS))
def test_each_remaining_format_parses_two_calls_whole_and_streamed(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Pythonic (Llama 3.2/4), Mistral and Qwen3-Coder templates: the parser is the
    template's, and two forced calls come back as two tool calls, whole and streamed."""
    folder = _tiny_family_checkpoint(
        tmp_path_factory.mktemp(f"tiny-{family}"), FAMILY_TEMPLATES[family]
    )
    stack = _start(folder, "--served-model-name", MODEL, "--enable-auto-tool-choice")
    try:
        assert any(
            f"tool-call parser from the chat template: {family}" in line for line in stack.log
        ), "".join(stack.log[-30:])
        client = _client(stack)
        kwargs = {
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER],
            "max_tokens": 400,
            "temperature": 0,
            "extra_body": {"guided_regex": _forced(PARALLEL_CALLS[family])},
        }
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        parsed = [
            (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
        ]
        assert [name for name, _ in parsed] == ["get_weather", "get_weather"]
        assert all(arguments["city"] in ("Paris", "Rome") for _, arguments in parsed)
        assert len({c.id for c in whole.message.tool_calls}) == 2
        content, calls, finish = _streamed_calls(
            client.chat.completions.create(stream=True, **kwargs)
        )
        assert finish == "tool_calls" and not content and calls == parsed
    finally:
        assert stack.stop() == 0, "".join(stack.log[-50:])
