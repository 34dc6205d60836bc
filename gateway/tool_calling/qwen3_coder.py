"""Qwen3-Coder XML tool calls, inside Hermes' ``<tool_call>`` tags::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Rome
    </parameter>
    </function>
    </tool_call>

Parameter values are bare text; each is typed by the tool's JSON schema
(integer, number, boolean, object, array; anything else stays a string), as
vLLM's qwen3_coder parser does. The arguments object streams one parameter at
a time: ``{"city": "Rome"`` once its ``</parameter>`` arrives, ``}`` at
``</function>``. Text before the first call is content.
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
from kvmesh.gateway.tool_calling.scanning import ScanningCallStream, split_at_marker

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
_NAME = re.compile(r"[^\s<>=]+")


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """The parameter's text as the JSON type its schema declares (text if it does not parse)."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    if value.strip().lower() == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            lowered = value.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            return value
        if kind in ("object", "array"):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return value


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolStream(ScanningCallStream):
    def __init__(
        self, functions: list[dict[str, Any]], make_id: IdFactory = new_tool_call_id
    ) -> None:
        # content, open, params, value, close, between, malformed
        super().__init__("content", make_id)
        self._schemas = {
            function["name"]: (function.get("parameters") or {}).get("properties") or {}
            for function in functions
        }
        self._function = ""
        self._parameter = ""
        self._num_parameters = 0
        self._unsent = ""  # markers consumed since the last call started

    def _malformed(self, events: list[StreamEvent]) -> None:
        # The markers of a call whose name never went out are content too.
        self._state = "malformed"
        events.append(self._unsent + self._pending)
        self._pending = self._unsent = ""

    def _expect(self, marker: str) -> bool | None:
        """Consume ``marker`` after whitespace: True; None while it may still come; else raise."""
        stripped = self._pending.lstrip()
        if stripped.startswith(marker):
            end = len(self._pending) - len(stripped) + len(marker)
            self._unsent += self._pending[:end]
            self._pending = stripped[len(marker) :]
            return True
        if marker.startswith(stripped):
            return None
        return False

    def _advance(self, events: list[StreamEvent]) -> bool:
        state = self._state
        index = self._num_calls - 1
        if state == "malformed":
            if self._pending:
                events.append(self._pending)
            self._pending = ""
            return False
        if state in ("content", "between"):
            if state == "content":
                content, rest = split_at_marker(self._pending, TOOL_CALL_START)
                if content:
                    events.append(content)
                if rest is None:
                    self._pending = self._pending[len(content) :]
                    return False
                self._pending = rest
                self._unsent = TOOL_CALL_START
            else:
                found = self._expect(TOOL_CALL_START)
                if not found:
                    if found is False:
                        raise MalformedCallError(f"expected {TOOL_CALL_START}")
                    return False
            self._state = "open"
            return True
        if state == "open":
            found = self._expect(FUNCTION_START)
            if found is None:
                return False
            if not found:
                raise MalformedCallError(f"expected {FUNCTION_START}")
            self._state = "name"
            return True
        if state == "name":
            name, rest = split_at_marker(self._pending, ">")
            if rest is None:
                if self._pending and not _NAME.fullmatch(self._pending):
                    raise MalformedCallError("expected a function name")
                return False
            if not _NAME.fullmatch(name):
                raise MalformedCallError("expected a function name")
            self._function = name
            self._num_parameters = 0
            self._unsent = ""
            events.append(ToolCallStart(self._num_calls, self._make_id(), name))
            self._num_calls += 1
            self._pending = rest
            self._state = "params"
            return True
        if state == "params":
            stripped = self._pending.lstrip()
            if stripped.startswith(PARAMETER_START):
                self._pending = stripped[len(PARAMETER_START) :]
                self._state = "parameter_name"
                return True
            if stripped.startswith(FUNCTION_END):
                self._pending = stripped[len(FUNCTION_END) :]
                events.append(ToolCallArguments(index, "}" if self._num_parameters else "{}"))
                self._state = "close"
                return True
            if any(marker.startswith(stripped) for marker in (PARAMETER_START, FUNCTION_END)):
                return False
            raise MalformedCallError(f"expected {PARAMETER_START} or {FUNCTION_END}")
        if state == "parameter_name":
            name, rest = split_at_marker(self._pending, ">")
            if rest is None:
                if self._pending and not _NAME.fullmatch(self._pending):
                    raise MalformedCallError("expected a parameter name")
                return False
            if not _NAME.fullmatch(name):
                raise MalformedCallError("expected a parameter name")
            self._parameter = name
            self._pending = rest
            self._state = "value"
            return True
        if state == "value":
            # A value ends at </parameter>; vLLM also accepts the next tag without it.
            ends = [
                (position, marker)
                for marker in (PARAMETER_END, PARAMETER_START, FUNCTION_END)
                if (position := self._pending.find(marker)) >= 0
            ]
            if not ends:
                return False
            position, marker = min(ends)
            raw = _strip_one_newline(self._pending[:position])
            schema = self._schemas.get(self._function, {}).get(self._parameter)
            value = _typed(raw, schema if isinstance(schema, dict) else None)
            try:
                value_json = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError):  # a Python literal JSON has no word for
                value_json = json.dumps(raw, ensure_ascii=False)
            separator = ", " if self._num_parameters else "{"
            key_json = json.dumps(self._parameter, ensure_ascii=False)
            text = f"{separator}{key_json}: {value_json}"
            events.append(ToolCallArguments(index, text))
            self._num_parameters += 1
            cut = position + len(marker) if marker == PARAMETER_END else position
            self._pending = self._pending[cut:]
            self._state = "params"
            return True
        # close: </tool_call> ends the call.
        found = self._expect(TOOL_CALL_END)
        if found is None:
            return False
        if not found:
            raise MalformedCallError(f"expected {TOOL_CALL_END}")
        self._state = "between"
        return True

    def finish(self) -> list[StreamEvent]:
        if self._state == "content":
            rest, self._pending = self._pending, ""
            return [rest] if rest else []
        if self._state == "between" and not self._pending.strip():
            return []
        if self._state != "malformed":
            self.ok = False
        rest, self._pending, self._unsent = self._unsent + self._pending, "", ""
        return [rest] if rest else []
