"""Shared constants and SSE parsing for the gateway tests."""

from __future__ import annotations

import json
from typing import Any

MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 256


def parse_sse(body: str) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded, with "[DONE]" kept as a string."""
    assert body.endswith("\n\n"), "an SSE body ends with a blank line"
    events: list[Any] = []
    for block in body.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
