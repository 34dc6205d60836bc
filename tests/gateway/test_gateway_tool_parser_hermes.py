"""Hermes <tool_call> parsing: what a client would get as content and tool_calls."""

from __future__ import annotations

import itertools
import json

import pytest

from kvmesh.gateway.tool_calling.events import (
    ParsedOutput,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    collect,
)
from kvmesh.gateway.tool_calling.hermes import HermesToolStream, parse_hermes_tool_calls


def parse(text: str) -> ParsedOutput:
    counter = itertools.count()
    return parse_hermes_tool_calls(text, make_id=lambda: f"call_{next(counter)}")


def test_plain_text_is_content() -> None:
    parsed = parse("The capital of France is Paris.")
    assert parsed.content == "The capital of France is Paris."
    assert parsed.tool_calls == []


def test_single_call_with_leading_text() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n'
        "</tool_call>"
    )
    parsed = parse(text)
    # As vLLM: the text before the first call, verbatim; arguments as generated.
    assert parsed.content == "Let me check.\n"
    assert parsed.tool_calls == [
        ToolCall(id="call_0", name="get_weather", arguments='{"city": "Zürich", "unit": "C"}')
    ]


def test_several_calls_keep_order_and_get_distinct_ids() -> None:
    text = "".join(
        f'<tool_call>{{"name": "f{i}", "arguments": {{"x": {i}}}}}</tool_call>\n' for i in range(3)
    )
    parsed = parse(text)
    assert parsed.content is None
    assert [call.name for call in parsed.tool_calls] == ["f0", "f1", "f2"]
    assert [json.loads(call.arguments) for call in parsed.tool_calls] == [
        {"x": i} for i in range(3)
    ]
    assert len({call.id for call in parsed.tool_calls}) == 3


def test_string_arguments_are_normalized_json() -> None:
    parsed = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(parsed.tool_calls[0].arguments) == {"a": 1}


def test_missing_arguments_mean_empty_object() -> None:
    parsed = parse('<tool_call>{"name": "now"}</tool_call>')
    assert parsed.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # cut off by max_tokens
        '<tool_call>{"name": "f"}</tool_call> and then some more prose',
    ],
)
def test_malformed_calls_fall_back_to_plain_content(text: str) -> None:
    parsed = parse(text)
    assert parsed.content == text
    assert parsed.tool_calls == []


STREAMED = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
    '"days": [1, 2], "note": "a \\"}\\" b"}}\n</tool_call>\n<tool_call>{"arguments": '
    '{}, "name": "now"}</tool_call>'
)


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_streamed_pieces_add_up_to_the_parsed_calls(piece: int) -> None:
    counter = itertools.count()
    stream = HermesToolStream(make_id=lambda: f"call_{next(counter)}")
    events = []
    for start in range(0, len(STREAMED), piece):
        events += stream.feed(STREAMED[start : start + piece])
    events += stream.finish()
    assert stream.ok
    assert collect(events) == parse(STREAMED)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "now")]
    first_arguments = [e for e in events if isinstance(e, ToolCallArguments) and e.index == 0]
    # The name goes out before any argument text, which streams in fragments.
    assert events.index(starts[0]) < events.index(first_arguments[0])
    if piece < 5:
        assert len(first_arguments) > 3
    assert json.loads("".join(e.text for e in first_arguments))["note"] == 'a "}" b'
    assert "".join(e for e in events if isinstance(e, str)) == "Checking."


def test_text_that_only_looks_like_a_call_start_is_content() -> None:
    stream = HermesToolStream()
    events = stream.feed("a <tool") + stream.feed("box> b") + stream.finish()
    assert "".join(events) == "a <toolbox> b" and stream.ok
