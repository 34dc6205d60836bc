"""What a parser turns generated text into: content, tool calls, and their streamed pieces.

Every tool-call parser is a ``ToolCallStream``: fed the generated text piece
by piece, it returns events: ``str`` for content to send now,
``ToolCallStart`` for a call whose function name is known (sent first, as
OpenAI and vLLM do), ``ToolCallArguments`` for the next fragment of its
arguments. A non-streamed response runs the same parser over the whole text
(``parse_whole``), so the two agree: the fragments of each call add up to its
``arguments``, and a generation the parser finds malformed is plain content.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


IdFactory = Callable[[], str]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    """A whole generation: reasoning (with a reasoning parser), content and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str


StreamEvent = str | ToolCallStart | ToolCallArguments


class ToolCallStream(Protocol):
    """One request's tool-call parser, fed the generated text as it arrives.

    ``feed`` returns the events the text so far allows (content is held back
    only while it could still start a call); ``finish`` returns the rest once
    the generation ended. ``ok`` turns False as soon as the text cannot be
    what the format expects: a whole-text parse then returns it all as
    content, and a stream, which cannot take back what it sent, sends the
    rest as content.
    """

    ok: bool

    def feed(self, text: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


def collect(events: list[StreamEvent]) -> ParsedOutput:
    """A whole response from the events of a whole generation."""
    content = "".join(event for event in events if isinstance(event, str))
    starts = [event for event in events if isinstance(event, ToolCallStart)]
    arguments = {start.index: "" for start in starts}
    for event in events:
        if isinstance(event, ToolCallArguments):
            arguments[event.index] += event.text
    calls = [ToolCall(start.id, start.name, arguments[start.index]) for start in starts]
    return ParsedOutput(content=content or None, tool_calls=calls)


def parse_whole(stream: ToolCallStream, text: str) -> ParsedOutput:
    """``text`` through a fresh ``stream``: its calls, or all of it as content if malformed."""
    events = stream.feed(text) + stream.finish()
    if not stream.ok:
        return ParsedOutput(content=text or None)
    return collect(events)
