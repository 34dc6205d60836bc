"""Pythonic tool calls: a Python list of calls, ``[get_weather(city="Rome"), now()]``.

Llama 3.2 (1B/3B, with a pythonic template) and Llama 4 write calls this way,
Llama 4 between ``<|python_start|>`` and ``<|python_end|>``. As in vLLM, the
output is calls only if it is such a list; anything else is content. Each
call's keyword arguments are Python literals, turned into a JSON object; a
call streams as soon as its closing parenthesis arrives.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    new_tool_call_id,
)
from kvmesh.gateway.tool_calling.json_call import MalformedCallError

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
# The start of a list of calls, and what can still grow into one.
_LIST_OF_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_LIST_OF_CALLS = re.compile(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?")


def _call_from_source(source: str) -> tuple[str, str]:
    """(name, arguments as JSON) of one call's source, e.g. ``f(a=1)``."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as exc:
        raise MalformedCallError(f"not a Python call: {exc.msg}") from exc
    if not isinstance(node, ast.Call) or node.args:
        raise MalformedCallError("a call takes keyword arguments only")
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise MalformedCallError("a call needs a function name")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise MalformedCallError("**kwargs are not arguments")
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError, TypeError) as exc:
            raise MalformedCallError(f"argument {keyword.arg} is not a literal") from exc
    try:
        return name, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # sets, bytes, complex numbers...
        raise MalformedCallError(f"arguments are not JSON: {exc}") from exc


class PythonicToolStream:
    """Content unless the output opens with ``[name(``; then one call per element."""

    def __init__(self, make_id: IdFactory = new_tool_call_id) -> None:
        self._make_id = make_id
        self._state = "start"  # start, list, after_list, content, malformed
        self._pending = ""
        self._consumed = ""  # the list's text so far (content again if it proves malformed)
        self._element = ""  # the current element's source
        self._depth = 0  # brackets open inside the list
        self._quote = ""  # the open string's quote character
        self._escape = False
        self._num_calls = 0
        self._element_done = False  # the element before the next "," or "]" was a call
        self._taken = 0  # characters of pending the last scan consumed
        self.ok = True

    def feed(self, text: str) -> list[StreamEvent]:
        self._pending += text
        events: list[StreamEvent] = []
        try:
            self._advance(events)
        except MalformedCallError:
            self.ok = False
            self._state = "malformed"
            rest = self._pending if self._num_calls else self._consumed + self._pending
            if rest:
                events.append(rest)
            self._pending = ""
        return events

    def _advance(self, events: list[StreamEvent]) -> None:
        if self._state in ("content", "malformed"):
            if self._pending:
                events.append(self._pending)
            self._pending = ""
            return
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(PYTHON_START):
                stripped = stripped[len(PYTHON_START) :].lstrip()
            elif PYTHON_START.startswith(stripped):
                return
            if _LIST_OF_CALLS.match(stripped):
                self._consumed = self._pending[: len(self._pending) - len(stripped)]
                self._pending = stripped
                self._state = "list"
            elif _MAYBE_LIST_OF_CALLS.fullmatch(stripped):
                return
            else:
                self._state = "content"
                events.append(self._pending)
                self._pending = ""
                return
        if self._state == "list":
            self._scan_list(events)
        if self._state == "after_list":
            stripped = self._pending.strip()
            if stripped.startswith(PYTHON_END):
                stripped = stripped[len(PYTHON_END) :].strip()
            if stripped and not PYTHON_END.startswith(stripped):
                raise MalformedCallError("text after the list of calls")

    def _scan_list(self, events: list[StreamEvent]) -> None:
        try:
            self._scan_list_from(events)
        finally:  # also when the list proves malformed: what was scanned is consumed
            self._pending = self._pending[self._taken :]

    def _scan_list_from(self, events: list[StreamEvent]) -> None:
        """Scan pending text; ``_taken`` counts the characters consumed (also on errors)."""
        self._taken = 0
        for index, char in enumerate(self._pending):
            self._taken = index + 1
            self._consumed += char
            if self._depth == 0:  # the list's own "["
                self._depth = 1
                continue
            if self._quote:
                self._element += char
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = ""
                continue
            if self._depth == 1 and char in ",]":
                if self._element.strip() or not self._element_done:
                    self._emit_call(events)  # raises on anything but a call
                self._element = ""
                self._element_done = False
                if char == "]":
                    self._depth = 0
                    self._state = "after_list"
                    return
                continue
            self._element += char
            if char in "\"'":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 1:
                    self._emit_call(events)

    def _emit_call(self, events: list[StreamEvent]) -> None:
        name, arguments = _call_from_source(self._element)
        call_id = self._make_id()
        events += [
            ToolCallStart(self._num_calls, call_id, name),
            ToolCallArguments(self._num_calls, arguments),
        ]
        self._num_calls += 1
        self._element = ""
        self._element_done = True

    def finish(self) -> list[StreamEvent]:
        if self._state == "start":
            rest, self._pending = self._pending, ""
            return [rest] if rest else []
        if self._state in ("content", "malformed"):
            return []
        if self._state != "after_list":
            self.ok = False
        return []
