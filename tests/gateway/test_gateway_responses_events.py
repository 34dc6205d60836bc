"""The streamed events of a response add up to the response built from the whole text."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.responses.events import ResponseEventWriter
from gateway.responses.output import output_items
from gateway.responses.protocol import OutputFunctionCall, OutputItem, OutputMessage
from gateway.responses.tool_parsing import parse_output, streaming_parser
from gateway.tool_calling import ToolPlan

FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object"}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
TEXTS = [
    "Plain text only.",
    f"Checking.{CALL}",
    f"{CALL}\n{CALL}",
    "",
    "<tool_call>{broken",
]


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
    return [
        ("message", item.content[0].text)
        if isinstance(item, OutputMessage)
        else ("function_call", f"{item.name}{item.arguments}")
        for item in items
    ]


@given(
    text=st.sampled_from(TEXTS),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=8),
    mode=st.sampled_from(["auto", "none"]),
)
def test_streamed_items_equal_the_whole_response(text: str, cuts: list[int], mode: str) -> None:
    plan = ToolPlan(mode, FUNCTIONS)  # type: ignore[arg-type]
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    parser = streaming_parser(plan)
    writer = ResponseEventWriter()
    sse: list[str] = []
    for piece in pieces:
        sse += writer.feed(parser.feed(piece))
    sse += writer.feed(parser.finish())
    sse += writer.finish("stop")
    whole = output_items(parse_output(plan, text), "stop")
    if "broken" not in text:  # a stream cannot take back content it sent; the whole can
        assert summary(writer.output) == summary(whole)
    events = parse_sse(sse)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    # Every item is added, then done, in order; deltas add up to the done values.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(writer.output)))
    for index, item in enumerate(writer.output):
        assert item.status == "completed"
        kind = "output_text" if isinstance(item, OutputMessage) else "function_call_arguments"
        deltas = "".join(
            e["delta"]
            for e in events
            if e["type"] == f"response.{kind}.delta" and e["output_index"] == index
        )
        expected = item.arguments if isinstance(item, OutputFunctionCall) else item.content[0].text
        assert deltas == expected
