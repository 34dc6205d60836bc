"""One generation's text, read as reasoning, answer and tool calls (streamed or whole).

``OutputParsing`` holds the server's choices (``--reasoning-parser``,
``--tool-call-parser``, ``--enable-auto-tool-choice``) and makes an
``OutputParser`` per generation. The parser is fed the generated text piece
by piece and returns events in generation order:

- ``ReasoningText``: thinking, sent as ``reasoning_content``;
- ``str``: answer text, sent as ``content``;
- ``ToolCallStart`` / ``ToolCallArguments``: a call's id and name, then
  fragments of its arguments that add up to the JSON text.

As in vLLM, the thinking is split off first and only the answer is read for
tool calls. ``parse`` runs the same machinery over a whole text for a
non-streamed response, so a stream adds up to it; output the tool format does
not fit stays content (never an error).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.reasoning import (
    REASONING_PARSERS,
    ReasoningParserSpec,
    ReasoningStream,
    ReasoningText,
)
from kvmesh.gateway.tokenizer import ChatTemplateError, Tokenizer
from kvmesh.gateway.tool_calling.events import (
    IdFactory,
    ParsedOutput,
    StreamEvent,
    ToolCallStart,
    ToolCallStream,
    collect,
    new_tool_call_id,
)
from kvmesh.gateway.tool_calling.forced import NamedCallStream, RequiredCallsStream
from kvmesh.gateway.tool_calling.plan import ToolPlan
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS, ToolParserSpec, detect_tool_parser
from kvmesh.services.contracts.sampling_params import StructuredOutputSpec
from kvmesh.services.runtime.config import GatewayConfig

logger = logging.getLogger(__name__)
OutputEvent = ReasoningText | StreamEvent


class OutputParser:
    """One generation's parser: reasoning first (if any), then tool calls in the answer."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        # Whether a call started (the finish reason becomes "tool_calls").
        self.called = False
        self._answer_text = ""  # the answer as generated, before tool parsing

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the generation opens inside the thinking (before anything was fed)."""
        return self._reasoning is not None and self._reasoning.in_reasoning

    @property
    def ok(self) -> bool:
        """False once the answer cannot be what the tool format expects."""
        return self._tools is None or self._tools.ok

    def feed(self, text: str) -> list[OutputEvent]:
        if self._reasoning is None:
            return self._answer([text] if text else [])
        return self._answer(self._reasoning.feed(text))

    def finish(self) -> list[OutputEvent]:
        events = self._answer(self._reasoning.finish() if self._reasoning is not None else [])
        if self._tools is not None:
            events += self._noting_calls(self._tools.finish())
        return events

    def _answer(self, pieces: list[ReasoningText | str]) -> list[OutputEvent]:
        """Thinking passes through; answer text goes through the tool parser."""
        events: list[OutputEvent] = []
        for piece in pieces:
            if isinstance(piece, ReasoningText) or self._tools is None:
                events.append(piece)
            else:
                self._answer_text += piece
                events += self._noting_calls(self._tools.feed(piece))
        return events

    def _noting_calls(self, events: list[StreamEvent]) -> list[StreamEvent]:
        self.called = self.called or any(isinstance(e, ToolCallStart) for e in events)
        return events

    def parse(self, text: str) -> ParsedOutput:
        """A whole generation (use a fresh parser): reasoning, content and calls."""
        events = self.feed(text) + self.finish()
        thinking = "".join(e.text for e in events if isinstance(e, ReasoningText))
        answer = [e for e in events if not isinstance(e, ReasoningText)]
        # Malformed calls: the answer as the model wrote it, without calls.
        parsed = collect(answer) if self.ok else ParsedOutput(content=self._answer_text or None)
        return ParsedOutput(parsed.content, parsed.tool_calls, thinking or None)


@dataclass(frozen=True)
class OutputParsing:
    """How the server reads generated text; one ``OutputParser`` per generation."""

    reasoning: ReasoningParserSpec | None = None
    tool_parser: ToolParserSpec | None = None
    # --enable-auto-tool-choice: "auto" parses calls with tool_parser.
    auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.auto_tool_choice and self.tool_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool call parser")

    def parser(
        self,
        plan: ToolPlan,
        prompt_text: str,
        template_kwargs: Mapping[str, Any] | None = None,
        make_id: IdFactory = new_tool_call_id,
    ) -> OutputParser:
        """A fresh parser for one generation of a request with this tool plan and prompt."""
        reasoning = (
            self.reasoning.stream(prompt_text, template_kwargs or {})
            if self.reasoning is not None
            else None
        )
        tools: ToolCallStream | None = None
        if plan.mode == "named":
            tools = NamedCallStream(plan.function_name or "", make_id)
        elif plan.mode == "required":
            tools = RequiredCallsStream(make_id)
        elif plan.mode == "auto" and self.tool_parser is not None:
            tools = self.tool_parser.stream(plan.functions, make_id)
        return OutputParser(reasoning, tools)

    def after_reasoning(
        self, spec: StructuredOutputSpec | None, parser: OutputParser, tokenizer: Tokenizer
    ) -> StructuredOutputSpec | None:
        """The constraint, applied only after the thinking when the generation starts in it
        (vLLM's order: reason freely, then answer in the required shape)."""
        if spec is None or self.reasoning is None or not parser.starts_in_reasoning:
            return spec
        end = tuple(tokenizer.encode(self.reasoning.end_tag, add_special_tokens=False))
        return dataclasses.replace(spec, reasoning_end_token_ids=end)

    def keeps_special_tokens(self, plan: ToolPlan) -> bool:
        """Whether the text must keep special tokens for the parsers to see their markers."""
        tool_markers = (
            plan.mode == "auto"
            and self.tool_parser is not None
            and self.tool_parser.keeps_special_tokens
        )
        return tool_markers or (self.reasoning is not None and self.reasoning.keeps_special_tokens)


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "kvmesh_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes tools into the prompt (else the gateway does)."""
    conversation = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(conversation)
        with_tools = tokenizer.apply_chat_template(conversation, tools=[_PROBE_TOOL])
    except ChatTemplateError:
        return True  # a template that refuses the probe is not one that ignores tools
    return plain != with_tools


def resolve_output_parsing(config: GatewayConfig, tokenizer: Tokenizer) -> OutputParsing:
    """The server's parsers from its flags; the tool parser defaults to the template's format.

    ``--enable-auto-tool-choice`` without a parser the template implies is an
    error at start-up: guessing would turn every call into plain content.
    """
    tool_parser_name = config.tool_call_parser
    renders_tools = template_renders_tools(tokenizer) if tokenizer.has_chat_template else True
    if not tool_parser_name and tokenizer.has_chat_template:
        tool_parser_name = detect_tool_parser(tokenizer.chat_template_source, renders_tools) or ""
        logger.info(
            "tool-call parser from the chat template: %s",
            tool_parser_name or "none (it names no single format; set --tool-call-parser)",
        )
    if tool_parser_name not in ("", "hermes") and not renders_tools:
        # The gateway writes tools into such prompts as Hermes text: the model is
        # asked for <tool_call> blocks this parser will not read.
        logger.warning(
            "the chat template ignores tools, so they are prompted as Hermes <tool_call> text, "
            "but --tool-call-parser is %s",
            tool_parser_name,
        )
    if config.enable_auto_tool_choice and not tool_parser_name:
        raise ValueError(
            "enable_auto_tool_choice needs --tool-call-parser: the chat template does not "
            f"imply one of {', '.join(TOOL_PARSERS)}"
        )
    parsing = OutputParsing(
        reasoning=REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser else None,
        tool_parser=TOOL_PARSERS[tool_parser_name] if tool_parser_name else None,
        auto_tool_choice=config.enable_auto_tool_choice,
    )
    logger.info(
        "output parsing: reasoning %s, tool calls %s, tool_choice auto %s",
        config.reasoning_parser or "off",
        tool_parser_name or "none",
        "on" if parsing.auto_tool_choice else "off (needs --enable-auto-tool-choice)",
    )
    return parsing
