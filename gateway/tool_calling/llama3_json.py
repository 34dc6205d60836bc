"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``.

Llama 3's chat template asks for one JSON object per call, optionally after
``<|python_tag|>`` (a special token: the gateway keeps special tokens in the
text for this parser), several separated by ``;``. As in vLLM, the output is
calls only if it starts with one; anything else is content. An object whose
``name`` is not one of the request's tools is content too: a model asked for
JSON answers with a JSON object, and that is not a call.
"""

from __future__ import annotations

from collections.abc import Collection

from kvmesh.gateway.tool_calling.events import IdFactory, StreamEvent, new_tool_call_id
from kvmesh.gateway.tool_calling.json_call import MalformedCallError
from kvmesh.gateway.tool_calling.scanning import ScanningCallStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolStream(ScanningCallStream):
    def __init__(self, names: Collection[str], make_id: IdFactory = new_tool_call_id) -> None:
        super().__init__("start", make_id)  # start, call, between, content, malformed
        self._known_names = frozenset(names)
        self._tag = ""  # the <|python_tag|> consumed, if any

    def _malformed(self, events: list[StreamEvent]) -> None:
        self._state = "malformed"
        text = self._unsent_call_text() + self._pending
        if self._num_calls <= 1:
            text = self._tag + text
        events.append(text)
        self._pending = ""

    def _advance(self, events: list[StreamEvent]) -> bool:
        state = self._state
        if state in ("content", "malformed"):
            if self._pending:
                events.append(self._pending)
            self._pending = ""
            return False
        if state == "call":
            if not self._feed_call(events):
                return False
            self._state = "between"
            return True
        stripped = self._pending.lstrip()
        if state == "start":
            if not self._tag and stripped.startswith(PYTHON_TAG):
                self._tag = self._pending[: len(self._pending) - len(stripped) + len(PYTHON_TAG)]
                self._pending = stripped[len(PYTHON_TAG) :]
                return True
            if not stripped or (not self._tag and PYTHON_TAG.startswith(stripped)):
                return False
            if stripped[0] != "{":
                self._state = "content"
                self._pending = self._tag + self._pending
                return True
            self._pending = stripped
            self._start_call()
            self._state = "call"
            return True
        # between: optional ";" then the next object.
        if stripped.startswith(";"):
            stripped = stripped[1:].lstrip()
        if not stripped:
            return False
        if stripped[0] != "{":
            raise MalformedCallError("expected ';' and another call")
        self._pending = stripped
        self._start_call()
        self._state = "call"
        return True

    def finish(self) -> list[StreamEvent]:
        if self._state in ("start", "content"):
            rest, self._pending = self._tag + self._pending, ""
            return [rest] if rest else []
        if self._state == "between" and self._pending.strip() in ("", ";"):
            return []
        unsent = ""
        if self._state != "malformed":
            self.ok = False
            unsent = self._unsent_call_text() if self._state == "call" else ""
        rest, self._pending = unsent + self._pending, ""
        return [rest] if rest else []
