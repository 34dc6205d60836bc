"""Hermes-style tool calls in generated text, streamed as they are generated.

Hermes, Qwen2.5 and many fine-tunes emit each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, optionally after
some plain text. ``HermesToolStream`` turns the text into content and call
events while it streams (gateway/tool_call_stream.py); ``parse_hermes_tool_calls``
runs it over a finished generation. As in vLLM, the text before the first call
is the content, verbatim. A generation with a malformed call block, a call cut
short, or prose after the calls is plain content with no calls when parsed
whole: guessing at half a call would hand the client arguments the model never
produced. A stream cannot take back what it sent; from such a point on it
sends the text as content.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_call_scanner import MalformedCallError
from gateway.tool_call_stream import (
    CallStreamer,
    ParsedOutput,
    ScanningCallStream,
    StreamEvent,
    collect,
    new_tool_call_id,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _held_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that could grow into ``marker``."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


class HermesToolStream(ScanningCallStream):
    """Content until the first ``<tool_call>``, then calls; ``ok``: still well formed."""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__("content")  # content, call, after_call, between, malformed
        self._make_id = make_id

    def _malformed(self, events: list[StreamEvent]) -> None:
        # From here on the text is content: a stream cannot take back what it sent.
        self._state = "malformed"
        events.append(self._pending)
        self._pending = ""

    def _advance(self, events: list[StreamEvent]) -> bool:
        """Consume what the current state can; True if the state changed (go again)."""
        pending = self._pending
        state = self._state
        if state == "malformed":
            if pending:
                events.append(pending)
            self._pending = ""
            return False
        if state == "content":
            start = pending.find(TOOL_CALL_START)
            safe = (
                start
                if start >= 0
                else len(pending) - _held_prefix_length(pending, TOOL_CALL_START)
            )
            if safe:
                events.append(pending[:safe])
            if start < 0:
                self._pending = pending[safe:]
                return False
            self._pending = pending[start + len(TOOL_CALL_START) :]
            self._start_call()
            return True
        if state == "call":
            assert self._call is not None
            taken, call_events = self._call.feed(pending)
            events += call_events
            self._pending = pending[taken:]
            if not self._call.scanner.done:
                return False
            events += self._call.finish()
            self._state = "after_call"
            return True
        # after_call expects the end marker, between expects the next call.
        marker = TOOL_CALL_END if state == "after_call" else TOOL_CALL_START
        stripped = pending.lstrip()
        if stripped.startswith(marker):
            self._pending = stripped[len(marker) :]
            if state == "after_call":
                self._state = "between"
            else:
                self._start_call()
            return True
        if stripped and not marker.startswith(stripped):
            raise MalformedCallError(f"expected {marker}")
        return False

    def _start_call(self) -> None:
        self._call = CallStreamer(self._num_calls, self._make_id)
        self._num_calls += 1
        self._state = "call"

    def finish(self) -> list[StreamEvent]:
        """Flush held content; a generation that ends inside a call is not well formed."""
        if self._state == "content":
            events: list[StreamEvent] = [self._pending] if self._pending else []
            self._pending = ""
            return events
        if self._state == "between" and not self._pending.strip():
            return []
        if self._state != "malformed":
            self.ok = False
        rest, self._pending = self._pending, ""
        return [rest] if rest else []


def parse_hermes_tool_calls(
    text: str, make_id: Callable[[], str] = new_tool_call_id
) -> ParsedOutput:
    """Split a finished ``text`` into leading content and the tool calls that follow it."""
    stream = HermesToolStream(make_id)
    events = stream.feed(text) + stream.finish()
    if not stream.ok:
        return ParsedOutput(content=text)
    return collect(events)
