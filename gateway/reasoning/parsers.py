"""The reasoning parsers by name (``--reasoning-parser``), as vLLM names them.

- ``qwen3``: ``<think> ... </think>``. Thinking unless the request sets
  ``chat_template_kwargs: {"enable_thinking": false}``; newer templates write
  ``<think>`` into the prompt, older ones leave it to the model.
- ``deepseek_r1``: ``<think> ... </think>`` (R1 and its Qwen/Llama distills,
  QwQ); the output is thinking until ``</think>``, whether or not the model
  writes ``<think>`` first.
- ``mistral``: Magistral's ``[THINK] ... [/THINK]`` special tokens; thinking
  only when the output opens with ``[THINK]``.

For all of them, a prompt that ends with the start tag (the template opened
the thinking) starts in the thinking, and one that ends with the end tag (the
template closed it, thinking disabled) starts in the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.reasoning.think_tags import ReasoningStream


@dataclass(frozen=True)
class ReasoningParserSpec:
    name: str
    start_tag: str
    end_tag: str
    # Think by default when nothing says otherwise (False: only after the start tag).
    thinks_by_default: bool
    # The template kwarg that turns thinking off when false (None: no such switch).
    switch_kwarg: str | None
    # The tags are special tokens, which detokenizing would drop.
    keeps_special_tokens: bool

    def stream(self, prompt_text: str, template_kwargs: Mapping[str, Any]) -> ReasoningStream:
        """A fresh parser for one generation from this prompt.

        Its ``in_reasoning`` at the start tells whether the generation opens
        inside the thinking for sure (structured output then waits for the
        end tag).
        """
        tail = prompt_text.rstrip()
        tags = (self.start_tag, self.end_tag)
        if tail.endswith(self.end_tag):  # the template closed the thinking
            return ReasoningStream(*tags, in_reasoning=False)
        if tail.endswith(self.start_tag):  # the template opened it
            return ReasoningStream(*tags, in_reasoning=True)
        if self.switch_kwarg is not None and template_kwargs.get(self.switch_kwarg) is False:
            return ReasoningStream(*tags, in_reasoning=False)
        return ReasoningStream(
            *tags,
            in_reasoning=self.thinks_by_default,
            needs_start_tag=not self.thinks_by_default,
        )


REASONING_PARSERS: dict[str, ReasoningParserSpec] = {
    spec.name: spec
    for spec in (
        ReasoningParserSpec("qwen3", "<think>", "</think>", True, "enable_thinking", False),
        ReasoningParserSpec("deepseek_r1", "<think>", "</think>", True, None, False),
        ReasoningParserSpec("mistral", "[THINK]", "[/THINK]", False, None, True),
    )
}
