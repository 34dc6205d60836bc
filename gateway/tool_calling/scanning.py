"""Building blocks of the streaming parsers: a buffered state machine, marker hold-back,
arrays of call objects, and the extent of a JSON value."""

from __future__ import annotations

from kvmesh.gateway.tool_calling.events import IdFactory, StreamEvent, new_tool_call_id
from kvmesh.gateway.tool_calling.json_call import CallStreamer, MalformedCallError


def held_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that could grow into ``marker``."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def split_at_marker(pending: str, marker: str) -> tuple[str, str | None]:
    """(text safe to send as content, the text after ``marker`` or None if not there yet).

    Without the marker, a tail that could be its start is held back: the
    returned content stops before it, and the caller keeps it pending.
    """
    start = pending.find(marker)
    if start >= 0:
        return pending[:start], pending[start + len(marker) :]
    return pending[: len(pending) - held_prefix_length(pending, marker)], None


class ScanningCallStream:
    """Base of the streaming call parsers: buffer text, advance a state machine.

    A subclass sets its first state, implements ``_advance`` (consume what the
    current state can; True when the state changed and it should run again)
    and ``_malformed`` (what to emit once the text stops being a well-formed
    call: ``ok`` turns False and the stream stays in that state).
    """

    def __init__(self, first_state: str, make_id: IdFactory = new_tool_call_id) -> None:
        self._pending = ""  # received, not yet consumed
        self._state = first_state
        self._call: CallStreamer | None = None
        self._num_calls = 0
        self._make_id = make_id
        # The text the open call consumed before its object (its opening marker).
        self._call_prefix = ""
        # When set, a call naming anything else is malformed (the text stays content).
        self._known_names: frozenset[str] | None = None
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

    def _start_call(self, prefix: str = "") -> CallStreamer:
        self._call = CallStreamer(self._num_calls, self._make_id, self._known_names)
        self._call_prefix = prefix
        self._num_calls += 1
        return self._call

    def _unsent_call_text(self) -> str:
        """What the open call consumed, if none of it went out yet (so it can be content)."""
        if self._call is None or self._call.started:
            return ""
        return self._call_prefix + self._call.scanner.text

    def _feed_call(self, events: list[StreamEvent]) -> bool:
        """Feed pending text to the open call object; True once it is complete."""
        assert self._call is not None
        scanned = len(self._call.scanner.text)
        try:
            taken, call_events = self._call.feed(self._pending)
        except MalformedCallError:
            # What the scanner took is the call's text now; the rest stays pending.
            self._pending = self._pending[len(self._call.scanner.text) - scanned :]
            raise
        events += call_events
        self._pending = self._pending[taken:]
        if not self._call.scanner.done:
            return False
        events += self._call.finish()
        return True


class CallArrayStream(ScanningCallStream):
    """A JSON array of call objects, ``[{"name": ..., "arguments": {...}}, ...]``.

    tool_choice "required" forces one with a grammar; Mistral writes one after
    ``[TOOL_CALLS]``. From the first character the text must be the array.
    """

    def __init__(self, make_id: IdFactory = new_tool_call_id) -> None:
        super().__init__("start", make_id)  # start, element, call, after_element, done

    def _malformed(self, events: list[StreamEvent]) -> None:
        self._state = "done"

    def _advance(self, events: list[StreamEvent]) -> bool:
        if self._state == "call":
            if not self._feed_call(events):
                return False
            self._state = "after_element"
            return True
        self._pending = self._pending.lstrip()
        if not self._pending or self._state == "done":
            return False
        char, self._pending = self._pending[0], self._pending[1:]
        if self._state == "start" and char == "[":
            self._state = "element"
        elif self._state == "element" and char == "{":
            self._start_call().feed("{")
            self._state = "call"
        elif self._state == "after_element" and char in ",]":
            self._state = "element" if char == "," else "done"
        else:
            raise MalformedCallError("expected an array of tool call objects")
        return True

    @property
    def complete(self) -> bool:
        return self._state == "done" and self.ok

    def finish(self) -> list[StreamEvent]:
        if self._state != "done" or self._pending.strip():
            self.ok = False
        return []


class JsonValueExtent:
    """Where a JSON object or array that is being generated ends (strings, escapes, nesting).

    Checks structure only; the caller parses the complete text.
    """

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the value; returns how many characters it took."""
        for offset, char in enumerate(text):
            if self.done:
                return offset
            self.text += char
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self.done = self._depth == 0
            elif self._depth == 0 and char not in " \t\r\n":
                raise MalformedCallError("expected a JSON object")
        return len(text)
