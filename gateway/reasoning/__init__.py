"""Reasoning output: the model's thinking, split from its answer (``--reasoning-parser``).

A ``ReasoningStream`` is fed the generated text as it arrives and returns
``ReasoningText`` pieces (the thinking, sent as ``reasoning_content``) and
``str`` pieces (the answer, which tool-call parsing then reads). The parsers
by name and how each decides where the thinking starts are in
gateway/reasoning/parsers.py.
"""

from kvmesh.gateway.reasoning.parsers import REASONING_PARSERS, ReasoningParserSpec
from kvmesh.gateway.reasoning.think_tags import ReasoningEvent, ReasoningStream, ReasoningText

__all__ = [
    "REASONING_PARSERS",
    "ReasoningEvent",
    "ReasoningParserSpec",
    "ReasoningStream",
    "ReasoningText",
]
