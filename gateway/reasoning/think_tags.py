"""Thinking between two tags, read as it is generated: ``<think> ... </think> answer``."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.gateway.tool_calling.scanning import split_at_marker


@dataclass(frozen=True)
class ReasoningText:
    """A piece of the model's thinking."""

    text: str


# A piece of thinking, or (``str``) a piece of the answer.
ReasoningEvent = ReasoningText | str


class ReasoningStream:
    """Splits generated text at the thinking's end tag.

    ``in_reasoning`` says where the generation starts: inside the thinking
    (the template opened it, or the family thinks by default) or in the
    answer. A start tag at the very beginning of the output is dropped (older
    templates leave it to the model); with ``needs_start_tag`` the output is
    thinking only if it begins with that tag. Without an end tag, everything
    after the start is thinking (a generation cut short), as vLLM does.
    """

    def __init__(
        self, start_tag: str, end_tag: str, in_reasoning: bool, needs_start_tag: bool = False
    ) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        # opening (a start tag may come), reasoning, content
        self._state = "opening" if in_reasoning or needs_start_tag else "content"
        self._reasoning_without_tag = in_reasoning and not needs_start_tag
        self._pending = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far is still thinking (structured output waits for its end)."""
        return self._state == "reasoning" or (
            self._state == "opening" and self._reasoning_without_tag
        )

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._pending += text
        events: list[ReasoningEvent] = []
        if self._state == "opening":
            stripped = self._pending.lstrip()
            if stripped.startswith(self._start_tag):
                self._pending = stripped[len(self._start_tag) :]
                self._state = "reasoning"
            elif not stripped or self._start_tag.startswith(stripped):
                return events  # may still be the start tag
            else:
                self._state = "reasoning" if self._reasoning_without_tag else "content"
        if self._state == "reasoning":
            thinking, rest = split_at_marker(self._pending, self._end_tag)
            if thinking:
                events.append(ReasoningText(thinking))
            if rest is None:
                self._pending = self._pending[len(thinking) :]
                return events
            self._pending = rest
            self._state = "content"
        if self._state == "content" and self._pending:
            events.append(self._pending)
            self._pending = ""
        return events

    def finish(self) -> list[ReasoningEvent]:
        """What was held back (a partial tag) once the generation ended."""
        rest, self._pending = self._pending, ""
        if not rest:
            return []
        if self._state == "opening":
            return [ReasoningText(rest) if self._reasoning_without_tag else rest]
        return [ReasoningText(rest) if self._state == "reasoning" else rest]
