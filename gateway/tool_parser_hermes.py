"""Parse Hermes-style tool calls out of generated text (not wired into the API yet).

Hermes, Qwen2.5 and many fine-tunes emit each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, optionally after
some plain text. This turns a finished generation into OpenAI's shape: the
leading text as ``content`` and each call as a function tool call whose
``arguments`` is a JSON string. A generation with any malformed call block is
returned as plain content with no calls: guessing at half a call would hand
the client arguments the model never produced.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_hermes_tool_calls(
    text: str, make_id: Callable[[], str] = new_tool_call_id
) -> ParsedOutput:
    """Split ``text`` into leading content and the tool calls that follow it."""
    if TOOL_CALL_START not in text:
        return ParsedOutput(content=text)
    blocks = list(_BLOCK.finditer(text))
    # Text after the last closed block must be whitespace; an unclosed block
    # (generation cut by max_tokens) makes the whole output plain content.
    trailing = text[blocks[-1].end() :] if blocks else text
    if not blocks or trailing.strip():
        return ParsedOutput(content=text)
    calls = []
    for block in blocks:
        call = _parse_block(block.group(1), make_id)
        if call is None:
            return ParsedOutput(content=text)
        calls.append(call)
    leading = text[: blocks[0].start()].strip()
    return ParsedOutput(content=leading or None, tool_calls=calls)


def _parse_block(body: str, make_id: Callable[[], str]) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        # Some models already serialize the arguments; accept them only if they are JSON.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(
        id=make_id(),
        name=payload["name"],
        arguments=json.dumps(arguments, ensure_ascii=False),
    )
