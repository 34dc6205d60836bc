"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, stream chunks).

The request models state every rule that holds for one field on its own:
types, ranges (int32 where the value travels as one), enums, non-empty
strings and lists. FastAPI enforces them (a refusal is a 400 naming the
field) and publishes them in /openapi.json, so the schema says what the server
accepts. What depends on the served model (its name, vocabulary size and
context length) and on the server's cost bounds (``--max-n``,
``--max-tokens-limit``, ``--max-tokens-per-request``) is marked with
``x-kvmesh-limit`` and filled in per server by gateway/openai/openapi_schema.py;
rules that tie several fields together live in ``gateway/engine_params/validation.py`` and
are described on the fields they involve.
Unknown fields are ignored, as OpenAI does. The models are strict, so ``true``
or ``"12"`` is refused instead of silently becoming a number (``json_int`` takes
2.0 for 2, as JSON Schema's integer does).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from kvmesh.services.contracts.sampling_params import TOP_N_SIGMA_MAX

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Seeds are int64, up to the largest one a JSON double holds exactly: a client
# (or a test generator) that passes numbers through floats stays in range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1024
# The most any server accepts; each serves at most its --max-n.
MAX_N = 128
MAX_LOGPROBS = 20


# Arguments of transformers' apply_chat_template: chat_template_kwargs are
# template variables only, never a client-supplied template or output format.
RESERVED_TEMPLATE_KWARGS = [
    "chat_template",
    "tokenize",
    "return_dict",
    "return_tensors",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "conversation",
    "messages",
]


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: 2 and 2.0, never true or "2" (pydantic checks the rest)."""
    if isinstance(value, bool | str):
        raise ValueError("Input should be an integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(**constraints: Any) -> Any:
    """An integer as JSON Schema defines it (the request models are otherwise strict).

    The bounds go inside, next to ``int``: after the validator pydantic would
    publish them as keywords JSON Schema does not know.
    """
    return Annotated[int, Field(strict=False, **constraints), BeforeValidator(_json_integer)]


def _limit(kind: str) -> dict[str, str]:
    """Marks a schema whose bound depends on the served model or the server's limits
    (gateway/openai/openapi_schema.py)."""
    return {"x-kvmesh-limit": kind}


def prompt_batch_limit() -> dict[str, str]:
    """Marks a list of prompts (or pooling inputs) in one call: at most
    ``--max-prompts-per-request`` items (``maxItems`` in the served schema)."""
    return _limit("prompts")


# A token id of the served model's vocabulary: [0, vocab_size).
TokenId = json_int(ge=0, json_schema_extra=_limit("token_id"))
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# The served model's name (OpenAI's "model"); absent means that model.
ModelName = Annotated[str, Field(json_schema_extra=_limit("model"))]
# Tokens to generate: at most max_model_len - 1 (the prompt needs one).
OutputLength = json_int(ge=1, json_schema_extra=_limit("output_len"))
NonEmptyString = Annotated[str, Field(min_length=1)]
Logprobs = json_int(ge=0, le=MAX_LOGPROBS)


class _Request(BaseModel):
    # Strict: a boolean is true or false, a string is a string, as the schema says.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextResponseFormat(_Request):
    type: Literal["text"]


class JsonObjectResponseFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(
        default=None,
        alias="json",
        description="A JSON schema, as an object or as its JSON text.",
    )
    regex: NonEmptyString | None = None
    choice: Annotated[list[NonEmptyString], Field(min_length=1)] | None = None
    grammar: NonEmptyString | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Parameters shared by completions and chat completions."""

    # The schema states the server's --max-tokens-per-request as x-max-tokens-per-request.
    model_config = ConfigDict(json_schema_extra=_limit("request_tokens"))

    model: ModelName | None = None
    n: json_int(ge=1, le=MAX_N, json_schema_extra=_limit("n")) = 1
    max_tokens: OutputLength | None = Field(
        default=None,
        description="With the prompt, at most the model's context length (max_model_len). "
        "Over all prompts x n choices, prompt tokens + max_tokens at most the server's "
        "x-max-tokens-per-request.",
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: json_int(ge=-1, le=INT32_MAX) | None = Field(
        default=None, description="0 or -1 disables top-k."
    )
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_n_sigma: Annotated[float, Field(ge=0.0, le=TOP_N_SIGMA_MAX)] | None = Field(
        default=None,
        description="Top-n-sigma (llama.cpp's top_n_sigma): keep tokens whose logit is at least "
        "the top logit minus top_n_sigma standard deviations of the logits. 0 or unset: off.",
    )
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    seed: json_int(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: NonEmptyString | list[NonEmptyString] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = Field(
        default=False, description="Cannot be combined with a structured output."
    )
    min_tokens: json_int(ge=0, json_schema_extra=_limit("output_len")) = Field(
        default=0, description="At most max_tokens."
    )
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(json_schema_extra=_limit("token_id_keys")),
        ]
        | None
    ) = Field(default=None, description="Token id (as a string) -> bias added to its logit.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="Only with stream true.")
    user: str | None = None
    # vLLM extensions.
    priority: json_int(ge=INT32_MIN, le=INT32_MAX) = 0
    cache_salt: NonEmptyString | None = None
    prompt_logprobs: Logprobs | None = Field(
        default=None, description="Above 0 only without stream."
    )
    return_tokens_as_token_ids: bool = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        default=None, description="Not with a structured output (guided_*, response_format)."
    )
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    truncate_prompt_tokens: (
        Literal[-1] | json_int(ge=1, json_schema_extra=_limit("context")) | None
    ) = Field(default=None, description="Keep the prompt's last k tokens; -1: max_model_len.")
    # Structured outputs (gateway/engine_params/structured_outputs.py): OpenAI's field, then
    # vLLM's older guided_* fields and its newer structured_outputs object; at
    # most one of them per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="A JSON schema, as an object or as its JSON text."
    )
    guided_regex: NonEmptyString | None = None
    guided_choice: Annotated[list[NonEmptyString], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyString | None = None
    structured_outputs: StructuredOutputsParams | None = None


class CompletionRequest(_SamplingFields):
    prompt: (
        NonEmptyString
        | Annotated[
            list[NonEmptyString], Field(min_length=1, json_schema_extra=prompt_batch_limit())
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra=prompt_batch_limit())]
    )
    echo: bool = False
    logprobs: Logprobs | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = Field(
        default=None, description="Not supported: only empty."
    )
    best_of: json_int(ge=1, le=MAX_N, json_schema_extra=_limit("n")) | None = Field(
        default=None, description="Only equal to n."
    )


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


MessageContent = str | list[TextContentPart]


class _Message(_Request):
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: MessageContent


class UserMessage(_Message):
    role: Literal["user"]
    content: MessageContent


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: MessageContent | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str | None = None


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(_Request):
    name: NonEmptyString
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: OutputLength | None = Field(
        default=None,
        description="Wins over max_tokens. With the prompt, at most max_model_len.",
    )
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(default=None, description="Only with logprobs true.")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description=(
            "auto, required or a named function need tools; the name must be one of them. "
            "auto (the default with tools) needs the server's --enable-auto-tool-choice."
        ),
    )
    parallel_tool_calls: bool | None = None
    # vLLM extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        default=False, description="Only with add_generation_prompt false."
    )
    chat_template_kwargs: (
        Annotated[
            dict[str, Any],
            Field(json_schema_extra={"propertyNames": {"not": {"enum": RESERVED_TEMPLATE_KWARGS}}}),
        ]
        | None
    ) = Field(default=None, description="Variables for the chat template.")


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def _now() -> int:
    return int(time.time())


class PromptLogprob(BaseModel):
    """vLLM's per-token entry of ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs layout: one entry per prompt token, None for the
# first; each maps token id (a string in JSON) to its logprob, the prompt
# token first, then the top alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM extension: the stop token id or stop string that ended the choice.
    stop_reason: int | str | None = None
    # vLLM extension: set when prompt logprobs were computed (prompt_logprobs,
    # or echo with logprobs).
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, serialized


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # vLLM's field: the thinking, split off by --reasoning-parser (null without one).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


def _without_none(handler: Any, model: BaseModel) -> dict[str, Any]:
    # OpenAI sends only what a delta carries: no null placeholders.
    return {key: value for key, value in handler(model).items() if value is not None}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_fields(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler, self)


class DeltaToolCall(BaseModel):
    """One streamed piece of a call: index, id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_fields(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler, self)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # vLLM extension: the rendered prompt's logprobs when prompt_logprobs was set.
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a piece of the thinking (--reasoning-parser)
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_fields(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only what changed: {"role": ...} first, then {"content": ...}, then {}.
        return _without_none(handler, self)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- other endpoints


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the API answers (OpenAI's shape); the status says which kind."""

    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"


class VersionResponse(BaseModel):
    version: str


# What batch-invariant mode costs, as measured (docs/performance.md, "Batch
# invariance"), for /v1/models where the engine runs in it.
BATCH_INVARIANT_COST = (
    "output tok/s x0.93 at 128 in / 128 out and x0.80 at 1,024 in / 64 out, median TTFT "
    "x1.34, concurrency 16 (float32, 2-core AMD EPYC Zen 2, AVX2; CPU-time clock): "
    "docs/performance.md, 'Batch invariance'"
)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvmesh"
    # A LoRA adapter's folder; its parent is the base model (vLLM's card).
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    # kvmesh's additions: the engine's compute dtype and why it was chosen.
    dtype: str | None = None
    dtype_reason: str | None = None
    # How the weights are held: "gguf" (block codes from a GGUF file) or "int8".
    quantization: str | None = None
    # Bytes of weights resident in the worker after loading (the worker's report).
    weight_bytes: int | None = None
    # Batch-invariant mode (--batch-invariant): a request's logits do not
    # depend on its batch; with its measured cost, in words (None: off).
    batch_invariant: bool | None = None
    batch_invariant_cost: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class _TokenizeFields(_Request):
    # Either form, not both: the other one's field is refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    model: ModelName | None = None
    return_token_strs: bool = False


class TokenizeCompletionRequest(_TokenizeFields):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # The template writes its own special tokens.
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: ModelName | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
