"""The tool-call parsers by name (``--tool-call-parser``) and the default a chat template implies.

Each family writes its calls its own way; a ``ToolParserSpec`` names one
format, makes a fresh ``ToolCallStream`` per generation and says whether the
format needs special tokens left in the text (``[TOOL_CALLS]`` is one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.tool_calling.events import IdFactory, ToolCallStream, new_tool_call_id
from kvmesh.gateway.tool_calling.hermes import HermesToolStream
from kvmesh.gateway.tool_calling.llama3_json import Llama3JsonToolStream
from kvmesh.gateway.tool_calling.mistral import MistralToolStream
from kvmesh.gateway.tool_calling.pythonic import PythonicToolStream
from kvmesh.gateway.tool_calling.qwen3_coder import Qwen3CoderToolStream

Functions = list[dict[str, Any]]


@dataclass(frozen=True)
class ToolParserSpec:
    name: str
    # A fresh parser for one generation, given the request's functions.
    make: Callable[[Functions, IdFactory], ToolCallStream]
    # The format's markers are special tokens, which detokenizing would drop.
    keeps_special_tokens: bool
    # Text whose presence in a chat template says the model writes this format.
    template_markers: tuple[str, ...]

    def stream(self, functions: Functions, make_id: IdFactory = new_tool_call_id) -> ToolCallStream:
        return self.make(functions, make_id)


TOOL_PARSERS: dict[str, ToolParserSpec] = {
    spec.name: spec
    for spec in (
        ToolParserSpec(
            "hermes", lambda functions, make_id: HermesToolStream(make_id), False, ("<tool_call>",)
        ),
        ToolParserSpec(
            "llama3_json",
            lambda functions, make_id: Llama3JsonToolStream(
                [function["name"] for function in functions], make_id
            ),
            True,
            ("<|python_tag|>", "dictionary of argument name and its value"),
        ),
        ToolParserSpec(
            "mistral",
            lambda functions, make_id: MistralToolStream(make_id),
            True,
            ("[TOOL_CALLS]",),
        ),
        ToolParserSpec(
            "pythonic",
            lambda functions, make_id: PythonicToolStream(make_id),
            True,
            ("[func_name1(", "<|python_start|>"),
        ),
        ToolParserSpec(
            "qwen3_coder",
            lambda functions, make_id: Qwen3CoderToolStream(functions, make_id),
            False,
            ("<function=",),
        ),
    )
}


def detect_tool_parser(template: str | None, template_renders_tools: bool) -> str | None:
    """The parser a chat template implies, or None when it does not say or says several.

    A template that ignores tools gets them as Hermes text from the gateway
    (gateway/tool_calling/prompt.py), so its model is asked for Hermes calls.
    Qwen3-Coder's template also writes ``<tool_call>``: its ``<function=``
    decides.
    """
    if not template:
        return None
    if not template_renders_tools:
        return "hermes"
    found = [
        spec.name
        for spec in TOOL_PARSERS.values()
        if any(marker in template for marker in spec.template_markers)
    ]
    if "qwen3_coder" in found and "hermes" in found:
        found.remove("hermes")
    return found[0] if len(found) == 1 else None
