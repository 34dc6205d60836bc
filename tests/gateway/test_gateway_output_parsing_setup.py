"""Which parsers a server runs: its flags, and the tool-call format its chat template implies."""

from __future__ import annotations

import logging

import pytest

from kvmesh.gateway.openai.output_parsing import resolve_output_parsing, template_renders_tools
from kvmesh.gateway.reasoning import REASONING_PARSERS
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.registry import TOOL_PARSERS, detect_tool_parser
from kvmesh.services.runtime.config import GatewayConfig
from kvmesh.services.runtime.config.choices import REASONING_PARSERS as REASONING_CHOICES
from kvmesh.services.runtime.config.choices import TOOL_CALL_PARSERS as TOOL_CHOICES
from kvmesh.services.runtime.model_prep import default_model_path
from tests.family_templates import FAMILY_TEMPLATES


def _with_template(template: str | None) -> Tokenizer:
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    tokenizer._hf.chat_template = template
    return tokenizer


def test_the_flags_choices_are_exactly_the_parsers() -> None:
    assert tuple(REASONING_PARSERS) == REASONING_CHOICES
    assert tuple(TOOL_PARSERS) == TOOL_CHOICES


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_each_family_template_implies_its_parser(tokenizer: Tokenizer, family: str) -> None:
    template = FAMILY_TEMPLATES[family]
    assert detect_tool_parser(template, template_renders_tools=True) == family
    parsing = resolve_output_parsing(
        GatewayConfig(enable_auto_tool_choice=True), _with_template(template)
    )
    assert parsing.tool_parser is TOOL_PARSERS[family] and parsing.auto_tool_choice


def test_a_template_that_ignores_tools_gets_hermes_text(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    # SmolLM2's template ignores tools: the gateway writes them as Hermes text.
    assert not template_renders_tools(tokenizer)
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway.openai.output_parsing"):
        parsing = resolve_output_parsing(GatewayConfig(), tokenizer)
    assert parsing.tool_parser is TOOL_PARSERS["hermes"]
    assert not parsing.auto_tool_choice  # the parser is known; "auto" still needs the flag
    assert "tool-call parser from the chat template: hermes" in caplog.text


def test_an_ambiguous_template_names_no_parser_and_auto_needs_the_flag() -> None:
    both = FAMILY_TEMPLATES["mistral"] + FAMILY_TEMPLATES["pythonic"]
    assert detect_tool_parser(both, template_renders_tools=True) is None
    assert detect_tool_parser(None, template_renders_tools=True) is None
    tokenizer = _with_template(both)
    assert resolve_output_parsing(GatewayConfig(), tokenizer).tool_parser is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        resolve_output_parsing(GatewayConfig(enable_auto_tool_choice=True), tokenizer)
    chosen = GatewayConfig(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    assert resolve_output_parsing(chosen, tokenizer).tool_parser is TOOL_PARSERS["pythonic"]


def test_an_explicit_parser_wins_over_the_template(tokenizer: Tokenizer) -> None:
    config = GatewayConfig(tool_call_parser="mistral", reasoning_parser="deepseek_r1")
    parsing = resolve_output_parsing(config, tokenizer)
    assert parsing.tool_parser is TOOL_PARSERS["mistral"]
    assert parsing.reasoning is REASONING_PARSERS["deepseek_r1"]


def test_unknown_parser_names_are_refused() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        GatewayConfig(tool_call_parser="harmony")
    with pytest.raises(ValueError, match="reasoning_parser"):
        GatewayConfig(reasoning_parser="o1")


def test_a_parser_other_than_hermes_for_a_template_that_ignores_tools_is_warned_about(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvmesh.gateway.openai.output_parsing"):
        resolve_output_parsing(GatewayConfig(tool_call_parser="pythonic"), tokenizer)
    assert "prompted as Hermes <tool_call> text, but --tool-call-parser is pythonic" in caplog.text
