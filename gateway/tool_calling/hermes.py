"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Hermes, Qwen2.5, Qwen3 and many fine-tunes emit each call this way,
optionally after some plain text. As in vLLM, the text before the first call
is the content, verbatim. A generation with a malformed call block, a call cut
short, or prose after the calls is plain content with no calls when parsed
whole: guessing at half a call would hand the client arguments the model never
produced. A stream cannot take back what it sent; from such a point on it
sends the text as content.
"""

from __future__ import annotations

from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    ParsedOutput,
    StreamEvent,
    new_tool_call_id,
    parse_whole,
)
from kvmesh.gateway.tool_calling.json_call import MalformedCallError
from kvmesh.gateway.tool_calling.scanning import ScanningCallStream, split_at_marker

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolStream(ScanningCallStream):
    """Content until the first ``<tool_call>``, then calls; ``ok``: still well formed."""

    def __init__(self, make_id: IdFactory = new_tool_call_id) -> None:
        super().__init__("content", make_id)  # content, call, after_call, between, malformed

    def _malformed(self, events: list[StreamEvent]) -> None:
        # From here on the text is content: a stream cannot take back what it sent.
        # Text of a call whose name never went out is still content.
        self._state = "malformed"
        events.append(self._unsent_call_text() + self._pending)
        self._pending = ""

    def _advance(self, events: list[StreamEvent]) -> bool:
        """Consume what the current state can; True if the state changed (go again)."""
        state = self._state
        if state == "malformed":
            if self._pending:
                events.append(self._pending)
            self._pending = ""
            return False
        if state == "content":
            content, rest = split_at_marker(self._pending, TOOL_CALL_START)
            if content:
                events.append(content)
            if rest is None:
                self._pending = self._pending[len(content) :]
                return False
            self._pending = rest
            self._start_call(TOOL_CALL_START)
            self._state = "call"
            return True
        if state == "call":
            if not self._feed_call(events):
                return False
            self._state = "after_call"
            return True
        # after_call expects the end marker, between expects the next call.
        marker = TOOL_CALL_END if state == "after_call" else TOOL_CALL_START
        stripped = self._pending.lstrip()
        if stripped.startswith(marker):
            self._pending = stripped[len(marker) :]
            if state == "after_call":
                self._state = "between"
            else:
                self._start_call(TOOL_CALL_START)
                self._state = "call"
            return True
        if stripped and not marker.startswith(stripped):
            raise MalformedCallError(f"expected {marker}")
        return False

    def finish(self) -> list[StreamEvent]:
        """Flush held content; a generation that ends inside a call is not well formed."""
        if self._state == "content":
            events: list[StreamEvent] = [self._pending] if self._pending else []
            self._pending = ""
            return events
        if self._state == "between" and not self._pending.strip():
            return []
        unsent = ""
        if self._state != "malformed":
            self.ok = False
            unsent = self._unsent_call_text() if self._state == "call" else ""
        rest, self._pending = unsent + self._pending, ""
        return [rest] if rest else []


def parse_hermes_tool_calls(text: str, make_id: IdFactory = new_tool_call_id) -> ParsedOutput:
    """Split a finished ``text`` into leading content and the tool calls that follow it."""
    return parse_whole(HermesToolStream(make_id), text)
