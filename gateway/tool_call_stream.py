"""What a streamed generation with tool calls turns into: content, then calls as deltas.

A parser (Hermes text, a forced function, a forced array of calls) turns
generated text into events: ``str`` for content to send now,
``ToolCallStart`` for a call whose function name is known (sent first, as
OpenAI and vLLM do), ``ToolCallArguments`` for the next fragment of its
arguments. A non-streamed response runs the same parser over the whole text,
so the two agree: the fragments of each call add up to its ``arguments``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.tool_call_scanner import CallScanner, MalformedCallError


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


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


class CallStreamer:
    """One call being generated: its start once the name is known, then argument fragments.

    An arguments object streams verbatim; arguments that are a JSON string
    (double-encoded) go out decoded, in one piece, once complete.
    """

    def __init__(self, index: int, make_id: Callable[[], str]) -> None:
        self.index = index
        self.id = make_id()
        self.scanner = CallScanner()
        self._started = False
        self._num_sent = 0  # characters of the arguments already sent

    def feed(self, text: str) -> tuple[int, list[StreamEvent]]:
        """Consume up to the end of the call object; (characters taken, events)."""
        taken = self.scanner.feed(text)
        events: list[StreamEvent] = []
        name = self.scanner.name
        if name is not None and not self._started:
            self._started = True
            events.append(ToolCallStart(self.index, self.id, name))
        arguments = self.scanner.value_text("arguments")
        if self._started and arguments and arguments.startswith("{"):
            events += self._arguments_up_to(arguments)
        return taken, events

    def finish(self) -> list[StreamEvent]:
        """The rest of the call once its object is complete (MalformedCallError if invalid)."""
        name, arguments = self.scanner.finish()
        events: list[StreamEvent] = []
        if not self._started:
            self._started = True
            events.append(ToolCallStart(self.index, self.id, name))
        return events + self._arguments_up_to(arguments)

    def _arguments_up_to(self, arguments: str) -> list[StreamEvent]:
        fragment = arguments[self._num_sent :]
        self._num_sent = len(arguments)
        return [ToolCallArguments(self.index, fragment)] if fragment else []


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


class ScanningCallStream:
    """Base of the streaming call parsers: buffer text, advance a state machine.

    A subclass sets its first state, implements ``_advance`` (consume what the
    current state can; True when the state changed and it should run again)
    and ``_malformed`` (what to emit once the text stops being a well-formed
    call: ``ok`` turns False and the stream stays in that state).
    """

    def __init__(self, first_state: str) -> None:
        self._pending = ""  # received, not yet consumed
        self._state = first_state
        self._call: CallStreamer | None = None
        self._num_calls = 0
        self.ok = True

    def feed(self, text: str) -> list[StreamEvent]:
        self._pending += text
        events: list[StreamEvent] = []
        try:
            while self._advance(events):
                pass
        except MalformedCallError:
            self.ok = False
            self._malformed(events)
        return events

    def _advance(self, events: list[StreamEvent]) -> bool:
        raise NotImplementedError

    def _malformed(self, events: list[StreamEvent]) -> None:
        raise NotImplementedError
