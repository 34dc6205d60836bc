"""Calls the grammar forced: a named function's arguments, or tool_choice "required"'s array.

These modes do not depend on the model's own format: the output is
constrained (gateway/tool_calling/plan.py) to JSON, and read here as it
streams.
"""

from __future__ import annotations

import json

from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    new_tool_call_id,
)
from kvmesh.gateway.tool_calling.scanning import CallArrayStream


class NamedCallStream:
    """tool_choice names the function: the whole output is its arguments object."""

    def __init__(self, name: str, make_id: IdFactory = new_tool_call_id) -> None:
        self._start = ToolCallStart(0, make_id(), name)
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


class RequiredCallsStream(CallArrayStream):
    """tool_choice "required": the output is a JSON array of call objects (grammar-forced)."""
