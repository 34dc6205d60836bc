"""The response object: the request's settings echoed, output items, status and usage.

A generation's text becomes output items through the chat path's output
parsing (gateway/openai/output_parsing.py): the thinking (with ``--reasoning-parser``)
is a ``reasoning`` item first, content is one assistant ``message`` item, each
call a ``function_call`` item whose ``call_id`` the client sends back with the
call's output. A generation cut short by ``max_output_tokens`` leaves the
response (and its last item) "incomplete", as OpenAI reports it.
"""

from __future__ import annotations

import uuid

from kvmesh.gateway.responses.protocol import (
    FunctionToolChoice,
    FunctionToolChoiceOut,
    FunctionToolOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    OutputTokensDetails,
    ReasoningConfigOut,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfigOut,
    TextFormatOut,
)
from kvmesh.gateway.tool_calling.events import ParsedOutput


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_status(finish_reason: str | None) -> ItemStatus:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(text: str, status: ItemStatus, item_id: str | None = None) -> OutputMessage:
    return OutputMessage(
        id=item_id or new_item_id("msg"), status=status, content=[OutputText(text=text)]
    )


def reasoning_item(text: str, status: ItemStatus) -> OutputReasoning:
    return OutputReasoning(
        id=new_item_id("rs"), status=status, content=[OutputReasoningText(text=text)]
    )


def output_items(parsed: ParsedOutput, finish_reason: str | None) -> list[OutputItem]:
    """A finished generation's items: its thinking (if any), its text (if any, or if there is
    nothing else), then calls."""
    status = item_status(finish_reason)
    items: list[OutputItem] = []
    if parsed.reasoning:
        # Cut short while thinking: the reasoning item is the one left incomplete.
        cut_in_thinking = parsed.content is None and not parsed.tool_calls
        items.append(reasoning_item(parsed.reasoning, status if cut_in_thinking else "completed"))
    if parsed.content or not (parsed.tool_calls or parsed.reasoning):
        items.append(message_item(parsed.content or "", status))
    items += [
        OutputFunctionCall(
            id=new_item_id("fc"),
            call_id=call.id,
            name=call.name,
            arguments=call.arguments,
            status="completed",
        )
        for call in parsed.tool_calls
    ]
    return items


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=num_prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
        output_tokens=num_output_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=num_prompt_tokens + num_output_tokens,
    )


def _text_config(request: ResponsesRequest) -> TextConfigOut:
    if request.text is None:
        return TextConfigOut()
    text_format = request.text.format
    if text_format is None:
        format_out = TextFormatOut()
    else:
        format_out = TextFormatOut.model_validate(text_format.model_dump(by_alias=True))
    return TextConfigOut(format=format_out, verbosity=request.text.verbosity)


def _tool_choice(request: ResponsesRequest) -> str | FunctionToolChoiceOut:
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return FunctionToolChoiceOut(name=choice.name)
    return choice or "auto"


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: ResponseStatus,
    output: list[OutputItem],
    response_usage: ResponseUsage | None = None,
    error: ResponseError | None = None,
) -> ResponseObject:
    """The response object for ``request`` in its current state."""
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        status=status,
        error=error,
        incomplete_details=(
            IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        ),
        instructions=request.instructions,
        model=model,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        text=_text_config(request),
        reasoning=(
            None
            if request.reasoning is None
            else ReasoningConfigOut.model_validate(request.reasoning.model_dump())
        ),
        tool_choice=_tool_choice(request),  # type: ignore[arg-type]
        tools=[
            FunctionToolOut.model_validate(tool.model_dump(exclude_none=True))
            for tool in request.tools or []
        ],
        store=request.store,
        metadata=request.metadata,
        user=request.user,
        usage=response_usage,
    )


def assistant_message(output: list[OutputItem]) -> dict[str, object]:
    """The output as the chat message the next turn's template sees."""
    text = "".join(
        part.text for item in output if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in output
        if isinstance(item, OutputFunctionCall)
    ]
    message: dict[str, object] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message
