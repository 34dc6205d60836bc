"""The per-generation parser: however the text is split, the stream adds up to the whole.

Engine deltas cut text anywhere (inside a marker, a JSON string, an escape);
every split of every sample must give the same reasoning, content and calls
as parsing the whole text, and the same ids (a stream's ids are the response's).
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from kvmesh.gateway.openai.output_parsing import OutputEvent, OutputParser, OutputParsing
from kvmesh.gateway.reasoning import REASONING_PARSERS, ReasoningText
from kvmesh.gateway.tool_calling.events import (
    ParsedOutput,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from kvmesh.gateway.tool_calling.plan import ToolPlan, plan_tool_choice
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from tests.gateway.tool_call_samples import MALFORMED, SAMPLES, TOOLS, Sample

PLAN = plan_tool_choice(TOOLS, "auto", None, auto_tool_choice=True)


def _parser(parsing: OutputParsing, plan: ToolPlan = PLAN, prompt: str = "") -> OutputParser:
    counter = itertools.count()
    return parsing.parser(plan, prompt, make_id=lambda: f"call_{next(counter)}")


def _splits(text: str) -> list[list[str]]:
    """The text in pieces of every size up to 7, and in a few random cuts."""
    splits = [[text[i : i + size] for i in range(0, len(text), size)] for size in range(1, 8)]
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        splits.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return splits


def _streamed(parser: OutputParser, pieces: list[str]) -> ParsedOutput:
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningText))
    content = "".join(e for e in events if isinstance(e, str))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    arguments = {s.index: "" for s in starts}
    for event in events:
        if isinstance(event, ToolCallArguments):
            assert event.index in arguments  # a call's start comes before its arguments
            arguments[event.index] += event.text
    calls = [ToolCall(s.id, s.name, arguments[s.index]) for s in starts]
    return ParsedOutput(content or None, calls, reasoning or None)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda sample: sample.id)
def test_every_split_of_a_sample_adds_up_to_its_calls(sample: Sample) -> None:
    parsing = OutputParsing(tool_parser=TOOL_PARSERS[sample.parser], auto_tool_choice=True)
    whole = _parser(parsing).parse(sample.text)
    assert whole.content == sample.content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == sample.calls
    assert [c.id for c in whole.tool_calls] == [f"call_{i}" for i in range(len(sample.calls))]
    for pieces in _splits(sample.text):
        assert _streamed(_parser(parsing), pieces) == whole, pieces


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda sample: sample.id)
@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_thinking_before_the_calls_splits_off_however_cut(sample: Sample, reasoning: str) -> None:
    parsing = OutputParsing(
        reasoning=REASONING_PARSERS[reasoning],
        tool_parser=TOOL_PARSERS[sample.parser],
        auto_tool_choice=True,
    )
    text = "<think>\nCall both, in parallel.\n</think>" + sample.text
    whole = _parser(parsing).parse(text)
    assert whole.reasoning == "\nCall both, in parallel.\n"
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == sample.calls
    for pieces in _splits(text):
        assert _streamed(_parser(parsing), pieces) == whole, pieces


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_text_is_content_whole_and_never_raises_when_streamed(
    parser: str, text: str
) -> None:
    parsing = OutputParsing(tool_parser=TOOL_PARSERS[parser], auto_tool_choice=True)
    whole = _parser(parsing).parse(text)
    assert whole == ParsedOutput(content=text)
    for pieces in _splits(text):
        streamed = _streamed(_parser(parsing), pieces)
        if not streamed.tool_calls:
            assert streamed.content == text, pieces


@pytest.mark.parametrize(
    ("prompt", "kwargs", "output", "expected"),
    [
        ("<|im_start|>assistant\n", {}, "a</think>b", ("a", "b")),
        ("<|im_start|>assistant\n<think>\n", {}, "a</think>b", ("a", "b")),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, "a</think>b", (None, "a</think>b")),
        (
            "<|im_start|>assistant\n",
            {"enable_thinking": False},
            "<think>a</think>b",
            (None, "<think>a</think>b"),
        ),
        ("<|im_start|>assistant\n", {}, "  <think>a", ("a", None)),
        ("<|im_start|>assistant\n", {}, "", (None, None)),
    ],
)
def test_where_qwen3_thinking_starts(
    prompt: str, kwargs: dict, output: str, expected: tuple[str | None, str | None]
) -> None:
    parsing = OutputParsing(reasoning=REASONING_PARSERS["qwen3"])
    parsed = parsing.parser(ToolPlan("none"), prompt, kwargs).parse(output)
    assert (parsed.reasoning, parsed.content) == expected


def test_forced_modes_read_the_answer_after_the_thinking() -> None:
    parsing = OutputParsing(reasoning=REASONING_PARSERS["deepseek_r1"])
    named = plan_tool_choice(
        TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, False
    )
    parsed = _parser(parsing, named).parse('Easy.</think>{"tz": "CET"}')
    assert parsed.reasoning == "Easy."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_time", '{"tz": "CET"}')]
    required = plan_tool_choice(TOOLS, "required", None, False)
    text = (
        'Both.</think>[{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    parsed = _parser(parsing, required).parse(text)
    assert [c.name for c in parsed.tool_calls] == ["get_time", "get_weather"]
