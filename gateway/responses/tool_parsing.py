"""The one place /v1/responses meets the tool-call parsers of the chat path.

Both functions take the chat request's ``ToolPlan`` (gateway/tool_calling.py)
and give what the chat path gives: events while streaming, a ``ParsedOutput``
for a whole generation. Per-family parsers plug in here, and only here.
"""

from __future__ import annotations

from typing import Protocol

from gateway.tool_call_modes import StreamingToolParser
from gateway.tool_call_stream import ParsedOutput, StreamEvent
from gateway.tool_calling import ToolPlan


class ToolStream(Protocol):
    def feed(self, text: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


class _PlainText:
    """tool_choice "none" (or no tools): every piece of text is content."""

    def feed(self, text: str) -> list[StreamEvent]:
        return [text] if text else []

    def finish(self) -> list[StreamEvent]:
        return []


def streaming_parser(plan: ToolPlan) -> ToolStream:
    """A parser of one streamed generation; feed() / finish() return its events."""
    if plan.mode == "none":
        return _PlainText()
    return StreamingToolParser(plan.mode, plan.function_name)


def parse_output(plan: ToolPlan, text: str) -> ParsedOutput:
    """A whole generation as content and calls; unparsable output stays content."""
    return plan.parse(text)
