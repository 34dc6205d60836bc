"""Tool calls streamed per tool_choice mode: Hermes text, a named function, or "required".

``StreamingToolParser`` picks the parser for a mode; each turns generated text
into the events of gateway/tool_call_stream.py, and ``tool_call_delta`` turns
a call event into OpenAI's streamed ``tool_calls`` entry.
"""

from __future__ import annotations

import json

from gateway.protocol import DeltaFunctionCall, DeltaToolCall
from gateway.tool_call_scanner import MalformedCallError
from gateway.tool_call_stream import (
    CallStreamer,
    ScanningCallStream,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    new_tool_call_id,
)
from gateway.tool_parser_hermes import HermesToolStream


def tool_call_delta(event: ToolCallStart | ToolCallArguments) -> DeltaToolCall:
    """OpenAI's chunk shape: id, type and name (arguments "") first, then argument fragments."""
    if isinstance(event, ToolCallStart):
        return DeltaToolCall(
            index=event.index,
            id=event.id,
            type="function",
            function=DeltaFunctionCall(name=event.name, arguments=""),
        )
    return DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))


class _NamedCallStream:
    """tool_choice names the function: the whole output is its arguments object."""

    def __init__(self, name: str) -> None:
        self._start = ToolCallStart(0, new_tool_call_id(), name)
        self._text = ""
        self.ok = True

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = [] if self._text else [self._start]
        self._text += text
        return [*events, ToolCallArguments(0, text)] if text else events

    def finish(self) -> list[StreamEvent]:
        try:
            self.ok = isinstance(json.loads(self._text), dict)
        except json.JSONDecodeError:
            self.ok = False  # cut short (max_tokens)
        return [] if self._text else [self._start]


class _RequiredCallsStream(ScanningCallStream):
    """tool_choice "required": the output is a JSON array of call objects (grammar-forced)."""

    def __init__(self) -> None:
        super().__init__("start")  # start, element, call, after_element, done

    def _malformed(self, events: list[StreamEvent]) -> None:
        self._state = "done"

    def _advance(self, events: list[StreamEvent]) -> bool:
        if self._state == "call":
            assert self._call is not None
            taken, call_events = self._call.feed(self._pending)
            events += call_events
            self._pending = self._pending[taken:]
            if not self._call.scanner.done:
                return False
            events += self._call.finish()
            self._state = "after_element"
            return True
        self._pending = self._pending.lstrip()
        if not self._pending or self._state == "done":
            return False
        char, self._pending = self._pending[0], self._pending[1:]
        if self._state == "start" and char == "[":
            self._state = "element"
        elif self._state == "element" and char == "{":
            self._call = CallStreamer(self._num_calls, new_tool_call_id)
            self._num_calls += 1
            self._call.feed("{")
            self._state = "call"
        elif self._state == "after_element" and char in ",]":
            self._state = "element" if char == "," else "done"
        else:
            raise MalformedCallError("expected an array of tool call objects")
        return True

    def finish(self) -> list[StreamEvent]:
        if self._state != "done" or self._pending.strip():
            self.ok = False
        return []


class StreamingToolParser:
    """Turns a streamed generation into content to send now and tool call deltas.

    "auto" streams content until a ``<tool_call>`` starts, then each call's
    name and argument fragments as they are generated; the forced modes
    stream their calls from the first token. ``ok`` turns False once the
    output cannot be what the mode expects.
    """

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        self._parser: HermesToolStream | _NamedCallStream | _RequiredCallsStream
        if mode == "named":
            self._parser = _NamedCallStream(function_name or "")
        elif mode == "required":
            self._parser = _RequiredCallsStream()
        else:
            self._parser = HermesToolStream()

        # Whether any call started (the finish reason becomes "tool_calls").
        self.called = False

    @property
    def ok(self) -> bool:
        return self._parser.ok

    def feed(self, text: str) -> list[StreamEvent]:
        return self._noting_calls(self._parser.feed(text))

    def finish(self) -> list[StreamEvent]:
        return self._noting_calls(self._parser.finish())

    def _noting_calls(self, events: list[StreamEvent]) -> list[StreamEvent]:
        self.called = self.called or any(isinstance(e, ToolCallStart) for e in events)
        return events
