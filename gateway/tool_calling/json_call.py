"""Read a tool call's JSON while it is being generated, one character at a time.

A call is an object ``{"name": "...", "arguments": {...}}`` (Llama 3 writes
``"parameters"`` instead of ``"arguments"``). ``CallScanner``
follows its structure as text arrives, so a stream can send the function's
name as soon as its string is closed and the arguments' text as it is
generated, exactly as it will read once complete: the arguments object is
passed on verbatim, never re-serialized, so the streamed fragments add up to
the arguments a non-streamed response returns. It checks structure, not every
JSON rule; ``finish`` runs the real parser over the whole object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
)

_WHITESPACE = " \t\r\n"
# The keys a call object may hold its arguments under, in order of preference.
ARGUMENT_KEYS = ("arguments", "parameters")


class MalformedCallError(ValueError):
    """The text cannot be a tool call object."""


@dataclass
class CallScanner:
    """One call object, fed in pieces; raises MalformedCallError as soon as it cannot be one."""

    text: str = ""
    done: bool = False
    # Top-level key -> (start, end) of its value in ``text``; end None while open.
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    _state: str = "start"  # start, key, in_key, colon, value, in_value, after_value
    _key_start: int = 0
    _key: str = ""
    _depth: int = 0  # nesting inside the current value
    _in_string: bool = False
    _escape: bool = False

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the object; returns how many characters it took."""
        for offset, char in enumerate(text):
            if self.done:
                return offset
            self._step(char)
            self.text += char
        return len(text)

    def _step(self, char: str) -> None:
        position = len(self.text)
        state = self._state
        if state == "in_value":
            self._step_value(char, position)
        elif state == "in_key":
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._key = json.loads(self.text[self._key_start :] + char)
                self._state = "colon"
        elif char in _WHITESPACE:
            return
        elif state == "start":
            self._expect(char == "{", "a tool call must be a JSON object")
            self._state = "key"
        elif state in ("key", "after_value"):
            if char == "}":
                self.done = True
            elif char == "," and state == "after_value":
                self._state = "key"
            else:
                self._expect(char == '"' and state == "key", "expected a key")
                self._key_start = position
                self._state = "in_key"
        elif state == "colon":
            self._expect(char == ":", "expected ':' after a key")
            self._state = "value"
        elif state == "value":
            self.values[self._key] = (position, None)
            self._state = "in_value"
            self._step_value(char, position)

    def _step_value(self, char: str, position: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 0:
                    self._close_value(position + 1)
            return
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            if self._depth == 0:  # a primitive value ends where its object does
                self._close_value(position)
                self.done = True
                return
            self._depth -= 1
            if self._depth == 0:
                self._close_value(position + 1)
        elif self._depth == 0 and char in ",":
            self._close_value(position)
            self._state = "key"
        elif self._depth == 0 and char in _WHITESPACE:
            self._close_value(position)

    def _close_value(self, end: int) -> None:
        start, _ = self.values[self._key]
        self.values[self._key] = (start, end)
        self._state = "after_value"

    @staticmethod
    def _expect(condition: bool, message: str) -> None:
        if not condition:
            raise MalformedCallError(message)

    def value_text(self, key: str) -> str | None:
        """The key's value as generated so far (None before it starts)."""
        span = self.values.get(key)
        if span is None:
            return None
        start, end = span
        return self.text[start:end]

    def is_closed(self, key: str) -> bool:
        span = self.values.get(key)
        return span is not None and span[1] is not None

    @property
    def arguments_key(self) -> str:
        """The key the arguments are under: the first of ARGUMENT_KEYS that started."""
        return next((key for key in ARGUMENT_KEYS if key in self.values), ARGUMENT_KEYS[0])

    @property
    def name(self) -> str | None:
        """The function's name once its string is complete."""
        if not self.is_closed("name"):
            return None
        try:
            name = json.loads(self.value_text("name") or "null")
        except json.JSONDecodeError as exc:  # e.g. an unquoted name
            raise MalformedCallError("a tool call's name must be a JSON string") from exc
        if not isinstance(name, str):
            raise MalformedCallError("a tool call's name must be a string")
        return name

    def finish(self) -> tuple[str, str]:
        """(name, arguments) of the complete object; arguments as generated, "{}" if absent.

        Arguments given as a JSON string holding a JSON object (some models
        double-encode them) are that string's content.
        """
        if not self.done:
            raise MalformedCallError("the tool call is incomplete")
        try:
            payload = json.loads(self.text)
        except json.JSONDecodeError as exc:
            raise MalformedCallError(str(exc)) from exc
        name = payload.get("name")
        if not isinstance(name, str):
            raise MalformedCallError("a tool call needs a name")
        key = self.arguments_key
        arguments = payload.get(key, {})
        raw = self.value_text(key)
        if isinstance(arguments, str):
            raw = arguments
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise MalformedCallError("arguments must be a JSON object") from exc
        if not isinstance(arguments, dict):
            raise MalformedCallError("arguments must be a JSON object")
        return name, raw if raw is not None else "{}"


class CallStreamer:
    """One call object being generated: its start once the name is known, then arguments.

    An arguments object streams verbatim; arguments that are a JSON string
    (double-encoded) go out decoded, in one piece, once complete.
    """

    def __init__(
        self, index: int, make_id: IdFactory, known_names: frozenset[str] | None = None
    ) -> None:
        self.index = index
        self.id = make_id()
        self._known_names = known_names
        self.scanner = CallScanner()
        self._started = False
        self._num_sent = 0  # characters of the arguments already sent

    @property
    def started(self) -> bool:
        """Whether the call's start (id, name) was emitted."""
        return self._started

    def feed(self, text: str) -> tuple[int, list[StreamEvent]]:
        """Consume up to the end of the call object; (characters taken, events)."""
        taken = self.scanner.feed(text)
        events: list[StreamEvent] = []
        name = self.scanner.name
        if name is not None and not self._started:
            self._check_name(name)
            self._started = True
            events.append(ToolCallStart(self.index, self.id, name))
        arguments = self.scanner.value_text(self.scanner.arguments_key)
        if self._started and arguments and arguments.startswith("{"):
            events += self._arguments_up_to(arguments)
        return taken, events

    def finish(self) -> list[StreamEvent]:
        """The rest of the call once its object is complete (MalformedCallError if invalid)."""
        name, arguments = self.scanner.finish()
        events: list[StreamEvent] = []
        if not self._started:
            self._check_name(name)
            self._started = True
            events.append(ToolCallStart(self.index, self.id, name))
        return events + self._arguments_up_to(arguments)

    def _check_name(self, name: str) -> None:
        if self._known_names is not None and name not in self._known_names:
            raise MalformedCallError(f"{name!r} is not one of the request's tools")

    def _arguments_up_to(self, arguments: str) -> list[StreamEvent]:
        fragment = arguments[self._num_sent :]
        self._num_sent = len(arguments)
        return [ToolCallArguments(self.index, fragment)] if fragment else []
