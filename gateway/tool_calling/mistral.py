"""Mistral tool calls, after the ``[TOOL_CALLS]`` special token, in either of its two forms.

- Tokenizers before v11 (Mistral 7B v0.3, Nemo, Small 3.1):
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, one array.
- v11 and later (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}``,
  repeated for each call.

Text before the first ``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` and
``[ARGS]`` are special tokens: the gateway keeps special tokens in the text
for this parser (as vLLM does).
"""

from __future__ import annotations

import json
import re

from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    new_tool_call_id,
)
from kvmesh.gateway.tool_calling.json_call import MalformedCallError
from kvmesh.gateway.tool_calling.scanning import (
    CallArrayStream,
    JsonValueExtent,
    ScanningCallStream,
    held_prefix_length,
    split_at_marker,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolStream(ScanningCallStream):
    def __init__(self, make_id: IdFactory = new_tool_call_id) -> None:
        # content, after_marker, array, name, arguments, between, malformed
        super().__init__("content", make_id)
        self._array: CallArrayStream | None = None
        self._arguments: JsonValueExtent | None = None
        self._unsent = ""  # the [TOOL_CALLS] consumed since the last call started

    def _malformed(self, events: list[StreamEvent]) -> None:
        # The marker of a call whose name never went out is content too.
        self._state = "malformed"
        events.append(self._unsent + self._pending)
        self._pending = self._unsent = ""

    def _advance(self, events: list[StreamEvent]) -> bool:
        state = self._state
        if state == "malformed":
            if self._pending:
                events.append(self._pending)
            self._pending = ""
            return False
        if state == "content":
            content, rest = split_at_marker(self._pending, TOOL_CALLS)
            if content:
                events.append(content)
            if rest is None:
                self._pending = self._pending[len(content) :]
                return False
            self._pending = rest
            self._unsent = TOOL_CALLS
            self._state = "after_marker"
            return True
        if state == "after_marker":
            stripped = self._pending.lstrip()
            if not stripped:
                return False
            self._unsent += self._pending[: len(self._pending) - len(stripped)]
            if stripped[0] == "[":  # an array; a function name never starts with "["
                if self._num_calls:
                    raise MalformedCallError("an array of calls after other calls")
                self._array = CallArrayStream(self._make_id)
                self._state = "array"
            else:
                self._state = "name"
            self._pending = stripped
            return True
        if state == "array":
            assert self._array is not None
            array_events = self._array.feed(self._pending)
            if array_events:
                self._unsent = ""
            events += array_events
            self._pending = ""
            if not self._array.ok:
                raise MalformedCallError("not an array of calls")
            return False
        if state == "name":
            name, rest = split_at_marker(self._pending, ARGS)
            if rest is None:
                # Still a name, or the start of [ARGS]?
                held = held_prefix_length(self._pending, ARGS)
                partial = self._pending[: len(self._pending) - held]
                if partial and not _NAME.fullmatch(partial.strip()):
                    raise MalformedCallError("expected a function name and [ARGS]")
                return False
            if not _NAME.fullmatch(name.strip()):
                raise MalformedCallError("expected a function name before [ARGS]")
            events.append(ToolCallStart(self._num_calls, self._make_id(), name.strip()))
            self._unsent = ""
            self._num_calls += 1
            self._pending = rest.lstrip()
            self._arguments = JsonValueExtent()
            self._state = "arguments"
            return True
        if state == "arguments":
            assert self._arguments is not None
            if not self._arguments.text:
                self._pending = self._pending.lstrip()
                if self._pending and self._pending[0] != "{":
                    raise MalformedCallError("arguments must be a JSON object")
            taken = self._arguments.feed(self._pending)
            if taken:
                events.append(ToolCallArguments(self._num_calls - 1, self._pending[:taken]))
            self._pending = self._pending[taken:]
            if not self._arguments.done:
                return False
            try:
                if not isinstance(json.loads(self._arguments.text), dict):
                    raise MalformedCallError("arguments must be a JSON object")
            except json.JSONDecodeError as exc:
                raise MalformedCallError(str(exc)) from exc
            self._state = "between"
            return True
        # between: the next [TOOL_CALLS], or nothing.
        stripped = self._pending.lstrip()
        if stripped.startswith(TOOL_CALLS):
            self._pending = stripped[len(TOOL_CALLS) :]
            self._unsent = TOOL_CALLS
            self._state = "name"
            return True
        if stripped and not TOOL_CALLS.startswith(stripped):
            raise MalformedCallError(f"expected {TOOL_CALLS}")
        return False

    def finish(self) -> list[StreamEvent]:
        if self._state == "content":
            rest, self._pending = self._pending, ""
            return [rest] if rest else []
        if self._state == "array":
            assert self._array is not None
            self._array.finish()
            self.ok = self._array.ok
            return []
        if self._state == "between" and not self._pending.strip():
            return []
        self.ok = False
        rest, self._pending, self._unsent = self._unsent + self._pending, "", ""
        return [rest] if rest else []
