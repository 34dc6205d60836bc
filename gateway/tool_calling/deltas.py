"""Parsed calls in OpenAI's shapes: a response's ``tool_calls`` and a stream's deltas."""

from __future__ import annotations

from kvmesh.gateway.openai.protocol import DeltaFunctionCall, DeltaToolCall
from kvmesh.gateway.openai.protocol import FunctionCall as FunctionCallModel
from kvmesh.gateway.openai.protocol import ToolCall as ToolCallModel
from kvmesh.gateway.tool_calling.events import ToolCall, ToolCallArguments, ToolCallStart


def tool_call_delta(event: ToolCallStart | ToolCallArguments) -> DeltaToolCall:
    """OpenAI's chunk shape: id, type and name (arguments "") first, then argument fragments.

    The OpenAI client's stream accumulator concatenates each index's
    ``arguments`` strings, so the fragments must add up to the JSON text.
    """
    if isinstance(event, ToolCallStart):
        return DeltaToolCall(
            index=event.index,
            id=event.id,
            type="function",
            function=DeltaFunctionCall(name=event.name, arguments=""),
        )
    return DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))


def tool_call_models(calls: list[ToolCall]) -> list[ToolCallModel]:
    return [
        ToolCallModel(
            id=call.id, function=FunctionCallModel(name=call.name, arguments=call.arguments)
        )
        for call in calls
    ]
