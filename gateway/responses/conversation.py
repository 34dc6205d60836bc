"""A Responses request as the chat completion request that generates it.

The input items become chat messages: messages keep their role and text, a
run of ``function_call`` items becomes one assistant message with
``tool_calls`` (joined to the assistant text just before it, as chat models
saw it), and a ``function_call_output`` becomes a ``tool`` message. The
conversation of ``previous_response_id`` (its stored messages) comes first, and
``instructions`` go before everything as a system message, which is why they are
not stored with the history (OpenAI does not carry them over either).

Function tools, ``tool_choice``, ``text.format``, ``max_output_tokens`` and the
sampling fields map one to one onto chat's, so the chat path validates them,
with one difference from chat: tools without a ``tool_choice`` on a server
without ``--enable-auto-tool-choice`` are rendered but not parsed
(``unparsed_tools``), as vLLM's Responses API answers in text there; an
explicit "auto" is refused as on chat. That is the Agents SDK's turn after a
forced call (it resets ``tool_choice`` by leaving it out). Reasoning items of
earlier turns are accepted and left out, as chat templates leave earlier
thinking out. ``reasoning.effort`` reaches the template as
``reasoning_effort`` (vLLM's mapping), and "none" also as ``enable_thinking``
false.
A forced call (``required`` or a named function) drops ``text.format``: such a
turn's output is a call, never text, so the format has nothing to apply to
(the Agents SDK sends both when an agent has an output type and a forced tool).
"""

from __future__ import annotations

from typing import Any

from kvmesh.gateway.openai.protocol import ChatCompletionRequest
from kvmesh.gateway.responses.protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponsesRequest,
)
from kvmesh.services.contracts.errors import InvalidRequestError

# A chat message as the chat request (and the store) hold it.
ChatMessageDict = dict[str, Any]


def _part_text(part: ContentPart) -> str:
    return part.refusal if part.type == "refusal" else part.text


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part) for part in content)


def _call(item: FunctionCallItem) -> dict[str, Any]:
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


def input_messages(request: ResponsesRequest) -> list[ChatMessageDict]:
    """The request's own input as chat messages (without instructions or history)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[ChatMessageDict] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(_call(item))
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [_call(item)]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
        # A ReasoningItem: earlier thinking, which templates leave out of the prompt.
    return messages


def _tool_choice(request: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def unparsed_tools(request: ResponsesRequest, auto_tool_choice: bool) -> bool:
    """Tools left to the default tool_choice on a server that parses no calls from text:
    the tools (and earlier calls) are in the prompt, the answer is text."""
    return request.tool_choice is None and bool(request.tools) and not auto_tool_choice


def _template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return None
    kwargs: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none":
        kwargs["enable_thinking"] = False
    return kwargs


def is_forced(request: ResponsesRequest) -> bool:
    return request.tool_choice is not None and request.tool_choice not in ("none", "auto")


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or is_forced(request):
        return None
    if text_format.type == "json_schema":
        json_schema: dict[str, Any] = {"name": text_format.name, "schema": text_format.schema_}
        if text_format.description is not None:
            json_schema["description"] = text_format.description
        if text_format.strict is not None:
            json_schema["strict"] = text_format.strict
        return {"type": "json_schema", "json_schema": json_schema}
    return {"type": text_format.type}


def chat_request(
    request: ResponsesRequest, history: list[ChatMessageDict]
) -> ChatCompletionRequest:
    """The chat completion request that generates this response after ``history``."""
    messages: list[ChatMessageDict] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    messages += history + input_messages(request)
    if not messages:
        raise InvalidRequestError(
            "input has no message or function call items (reasoning items alone are left out)",
            param="input",
        )
    body: dict[str, Any] = {
        "messages": messages,
        "model": request.model,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request),
        "user": request.user,
        "chat_template_kwargs": _template_kwargs(request),
    }
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    # Strict validation of values that were validated once already: only the
    # shapes differ, so this never refuses what the Responses model accepted.
    return ChatCompletionRequest.model_validate(
        {key: value for key, value in body.items() if value is not None}
    )
