"""Pydantic models of /v1/responses: the request, the response object and its output items.

Only what the server does is accepted: function tools (no hosted tools),
text input (no images or files), ``truncation`` "disabled" and no
``background``; anything else is a 400 naming the field, and the schema in
/openapi.json says the same. Like the other request models
(gateway/openai/protocol.py) these are strict and ignore unknown fields, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from kvmesh.gateway.openai.protocol import (
    ModelName,
    NonEmptyString,
    OutputLength,
    _Request,
)

# ---------------------------------------------------------------- request: input items


class InputTextPart(_Request):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Request):
    """Text of an earlier assistant message, sent back as history."""

    type: Literal["output_text"]
    text: str


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputTextPart | OutputTextPart | RefusalPart, Field(discriminator="type")]


class MessageItem(_Request):
    """A message: the easy form (content a string) or a list of text parts."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn (as the previous response's output had it)."""

    type: Literal["function_call"]
    call_id: NonEmptyString
    name: NonEmptyString
    arguments: str = Field(description="A JSON object, serialized.")
    id: str | None = None


class FunctionCallOutputItem(_Request):
    """The client's result of running a call."""

    type: Literal["function_call_output"]
    call_id: NonEmptyString
    output: str | list[ContentPart]
    id: str | None = None


def _item_type(item: Any) -> str:
    """An item's type; a message may leave it out (OpenAI's easy input message)."""
    if isinstance(item, dict):
        kind = item.get("type")
        if kind is None:
            return "message"
        return kind if isinstance(kind, str) else ""
    return getattr(item, "type", None) or "message"


class ReasoningTextPart(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier response's reasoning item, sent back with the history.

    Accepted so that clients can send a response's output back as input (as
    OpenAI's guide and vLLM's examples do); chat templates leave the thinking
    of earlier turns out of the prompt, so it is not rendered.
    """

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="input_item_type",
        custom_error_message="an input item is a message, a function_call, a "
        "function_call_output or a reasoning item (text only)",
    ),
]


# ---------------------------------------------------------------- request: tools and text


class FunctionTool(_Request):
    type: Literal["function"]
    name: NonEmptyString
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments object."
    )
    strict: bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: NonEmptyString


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJsonObject(_Request):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: NonEmptyString
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="Accepted and echoed; the model is not told."
    )


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ReasoningConfig(_Request):
    """How much the model should think (reasoning models only).

    As in vLLM, ``effort`` reaches the chat template as ``reasoning_effort``
    (gpt-oss style templates read it); "none" also sets ``enable_thinking``
    false, which Qwen3-style templates read to skip the thinking.
    """

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="Accepted and echoed; the thinking comes back whole."
    )


# OpenAI's bounds: 16 pairs, values up to 512 characters.
Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: ModelName | None = None
    input: Annotated[list[InputItem], Field(min_length=1)] | str
    instructions: str | None = Field(
        default=None,
        description="A system message before the input; not carried over by previous_response_id.",
    )
    previous_response_id: NonEmptyString | None = Field(
        default=None,
        description="Continue the conversation of a stored response (404 when it is not kept).",
    )
    store: bool = Field(default=True, description="Keep the response for GET and continuation.")
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = Field(
        default=None,
        description="auto, required or a named function need tools; the name must be one of them.",
    )
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: OutputLength | None = Field(
        default=None, description="With the prompt, at most the model's context length."
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    metadata: Metadata | None = Field(default=None, description="Echoed in the response.")
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(
        default=None, description="Only disabled: a prompt over the context length is a 400."
    )
    background: Literal[False] | None = Field(default=None, description="Not supported: false.")


# ---------------------------------------------------------------- response object


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The thinking (with ``--reasoning-parser``): its text as content, no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    """Why a response failed (status "failed"), as OpenAI's response object carries it."""

    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


ResponseStatus = Literal["completed", "failed", "in_progress", "incomplete"]


class FunctionToolOut(BaseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoiceOut(BaseModel):
    type: Literal["function"] = "function"
    name: str


class TextFormatOut(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfigOut(BaseModel):
    format: TextFormatOut = Field(default_factory=TextFormatOut)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfigOut(BaseModel):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseObject(BaseModel):
    """OpenAI's response object: the request's settings, its output items and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfigOut
    reasoning: ReasoningConfigOut | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoiceOut
    tools: list[FunctionToolOut]
    truncation: Literal["disabled"] = "disabled"
    store: bool
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True
