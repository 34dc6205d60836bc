"""The streamed events of a response add up to the response built from the whole text.

The generation goes through the server's output parser (gateway/openai/output_parsing.py)
as /v1/responses runs it: every tool-call format's recorded-style sample, with
and without thinking before it, cut into arbitrary pieces.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.gateway.openai.output_parsing import OutputParsing
from kvmesh.gateway.reasoning import REASONING_PARSERS
from kvmesh.gateway.responses.events import ResponseEventWriter
from kvmesh.gateway.responses.output import output_items
from kvmesh.gateway.responses.protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
)
from kvmesh.gateway.tool_calling.plan import ToolPlan
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS
from tests.gateway.tool_call_samples import MALFORMED, SAMPLES, TOOLS

FUNCTIONS = [tool["function"] for tool in TOOLS]
# (tool parser, generated text, whether the format reads it as calls)
TEXTS = [(sample.parser, sample.text, True) for sample in SAMPLES]
TEXTS += [(parser, text, False) for parser, text in MALFORMED]
TEXTS += [("hermes", "Plain text only.", True), ("hermes", "", True)]
THINKING = "<think>\nThe user wants [TOOL_CALLS] two calls.\n</think>\n"


def parse_sse(sse: list[str]) -> list[dict]:
    events = []
    for block in sse:
        head, data = block.rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def summary(items: list[OutputItem]) -> list[tuple[str, str]]:
    """Items without their ids: (type, text or name + arguments)."""
    views = []
    for item in items:
        if isinstance(item, OutputMessage):
            views.append(("message", item.content[0].text))
        elif isinstance(item, OutputReasoning):
            views.append(("reasoning", item.content[0].text))
        else:
            views.append(("function_call", f"{item.name}{item.arguments}"))
    return views


def _delta_kind(item: OutputItem) -> str:
    if isinstance(item, OutputMessage):
        return "output_text"
    if isinstance(item, OutputReasoning):
        return "reasoning_text"
    return "function_call_arguments"


def _done_value(item: OutputItem) -> str:
    return item.arguments if isinstance(item, OutputFunctionCall) else item.content[0].text


@given(
    sample=st.sampled_from(TEXTS),
    think=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    mode=st.sampled_from(["auto", "none"]),
)
def test_streamed_items_equal_the_whole_response(
    sample: tuple[str, str, bool], think: bool, cuts: list[int], mode: str
) -> None:
    parser_name, answer, well_formed = sample
    text = THINKING + answer if think else answer
    parsing = OutputParsing(
        reasoning=REASONING_PARSERS["deepseek_r1"] if think else None,
        tool_parser=TOOL_PARSERS[parser_name],
        auto_tool_choice=True,
    )
    plan = ToolPlan(mode, FUNCTIONS)  # type: ignore[arg-type]
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    parser = parsing.parser(plan, "prompt")
    writer = ResponseEventWriter()
    sse: list[str] = []
    for piece in pieces:
        sse += writer.feed(parser.feed(piece))
    sse += writer.feed(parser.finish())
    sse += writer.finish("stop")
    whole = output_items(parsing.parser(plan, "prompt").parse(text), "stop")
    if well_formed or mode == "none":  # a stream cannot take back content it sent; the whole can
        assert summary(writer.output) == summary(whole)
    if think:
        assert summary(whole)[0] == (
            "reasoning",
            THINKING.removeprefix("<think>")[: -len("</think>\n")],
        )
    events = parse_sse(sse)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    # Every item is added, then done, in order; deltas add up to the done values.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(writer.output)))
    for index, item in enumerate(writer.output):
        assert item.status == "completed"
        kind = _delta_kind(item)
        deltas = "".join(
            e["delta"]
            for e in events
            if e["type"] == f"response.{kind}.delta" and e["output_index"] == index
        )
        assert deltas == _done_value(item)


def test_thinking_cut_short_leaves_the_reasoning_item_incomplete() -> None:
    parsing = OutputParsing(reasoning=REASONING_PARSERS["qwen3"])
    text = "<think>Counting: one, two"
    parser = parsing.parser(ToolPlan("none"), "prompt")
    writer = ResponseEventWriter()
    writer.feed(parser.feed(text) + parser.finish())
    writer.finish("length")
    whole = output_items(parsing.parser(ToolPlan("none"), "prompt").parse(text), "length")
    for items in (writer.output, whole):
        (item,) = items
        assert isinstance(item, OutputReasoning) and item.status == "incomplete"
        assert item.content[0].text == "Counting: one, two"
