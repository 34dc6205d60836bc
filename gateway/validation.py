"""Turn an API request into engine inputs, refusing anything out of range with a 400.

Each refusal is an ``InvalidRequestError`` whose ``param`` names the offending field,
so clients see ``{"error": {"param": "temperature", ...}}`` like OpenAI's.
Limits follow OpenAI where it documents one and vLLM otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.engine_client import ModelInfo
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.structured_outputs import structured_output_spec
from gateway.tokenizer import ChatTemplateError, Tokenizer
from gateway.tool_calling import messages_with_tools_in_text, tool_calls_for_template
from services.errors import InvalidRequestError, NotFoundError
from services.sampling_params import DetokenizeParams, SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20
# OpenAI's default for /v1/completions; chat defaults to the room left in the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Arguments of transformers' apply_chat_template: chat_template_kwargs are
# template variables only, never a client-supplied template or output format.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
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
    }
)


@dataclass(frozen=True)
class Prompt:
    """One validated prompt: its token ids and, for echo, its text."""

    token_ids: list[int]
    text: str


def check_model(requested: str | None, served_model_name: str) -> None:
    # An absent model means "the one you serve", as vLLM allows.
    if requested is not None and requested != served_model_name:
        raise NotFoundError(
            f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )


def _check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param=param
            )


def completion_prompts(
    request: CompletionRequest, tokenizer: Tokenizer, max_prompts: int
) -> list[Prompt]:
    """The request's prompts (one, or a batch), counted, then tokenized and checked."""
    raw = request.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(item, int) for item in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if len(items) > max_prompts:
        raise InvalidRequestError(
            f"at most {max_prompts} prompts per request, got {len(items)}", param="prompt"
        )
    prompts = []
    for item in items:
        if isinstance(item, str):
            token_ids = tokenizer.encode(item, add_special_tokens=True)
            text = item
        else:
            _check_token_ids(item, tokenizer.vocab_size, "prompt")
            token_ids = list(item)
            text = tokenizer.decode(token_ids, skip_special_tokens=False)
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        prompts.append(Prompt(token_ids=token_ids, text=text))
    return prompts


def _message_text(message: ChatMessage, index: int) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content parts of type {part.type!r} are not supported; send text parts",
                param=f"messages.{index}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: plain dicts with string content."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        text = _message_text(message, index)
        if text is None and not message.tool_calls:
            raise InvalidRequestError(
                f"a {message.role} message needs content", param=f"messages.{index}.content"
            )
        # Few templates know "developer"; OpenAI defines it as the new name of "system".
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": text if text is not None else "",
        }
        for key in ("name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                entry[key] = value
        if message.tool_calls:
            entry["tool_calls"] = tool_calls_for_template(message.tool_calls)
        rendered.append(entry)
    return rendered


def render_chat(
    messages: list[ChatMessage],
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as prompt text, through the model's own chat template.

    With ``tools``, a template that ignores them (renders the same text with and
    without) gets the tools and earlier calls written into the messages instead.
    """
    reserved = _RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs"
        )
    conversation = template_messages(messages)
    kwargs = template_kwargs or {}
    try:
        plain = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if not tools:
            return plain
        with_tools = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        if with_tools != plain:
            return with_tools
        return tokenizer.apply_chat_template(
            messages_with_tools_in_text(conversation, tools),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


def chat_prompt(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    text = render_chat(
        request.messages,
        tokenizer,
        request.add_generation_prompt,
        request.chat_template_kwargs,
        tools,
    )
    # The template already wrote any BOS it wants.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if not token_ids:
        raise InvalidRequestError("messages rendered to an empty prompt", param="messages")
    return Prompt(token_ids=token_ids, text=text)


def _check_range(
    value: float | None, name: str, low: float, high: float, low_open: bool = False
) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(
            f"{name} must be in {bracket}{low}, {high}], got {value}", param=name
        )


def check_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse features that are not implemented yet instead of ignoring them."""
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise InvalidRequestError("best_of is not supported", param="best_of")
        if request.echo and request.logprobs is not None:
            # OpenAI would score the prompt tokens too; the engine does not compute those yet.
            raise InvalidRequestError(
                "echo together with logprobs is not supported yet", param="echo"
            )
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream"
        )


def _max_tokens(
    requested: int | None,
    param: str,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
) -> int:
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {prompt_len} tokens.",
            param=prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        if default is None:
            return room
        requested = default
    elif requested < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} in the completion).",
            param=param,
        )
    return requested


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    bias = []
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is out of range", "logit_bias"
            )
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise InvalidRequestError(
                "logit_bias values must be in [-100, 100]", param="logit_bias"
            )
        bias.append((token_id, float(value)))
    return tuple(bias)


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not item for item in strings):
        raise InvalidRequestError("stop strings must not be empty", param="stop")
    return tuple(strings)


def _requested_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, CompletionRequest):
        _check_range(request.logprobs, "logprobs", 0, MAX_LOGPROBS)
        return request.logprobs
    _check_range(request.top_logprobs, "top_logprobs", 0, MAX_LOGPROBS)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, prompt_len: int, model: ModelInfo
) -> SamplingParams:
    """The engine's sampling parameters for one prompt of ``request``."""
    _check_range(request.n, "n", 1, MAX_N)
    _check_range(request.temperature, "temperature", 0.0, 2.0)
    _check_range(request.top_p, "top_p", 0.0, 1.0, low_open=True)
    _check_range(request.min_p, "min_p", 0.0, 1.0)
    _check_range(request.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(request.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(request.repetition_penalty, "repetition_penalty", 0.0, 2.0, low_open=True)
    _check_range(request.seed, "seed", _INT64_MIN, _INT64_MAX)
    _check_range(request.priority, "priority", _INT64_MIN, _INT64_MAX)
    if request.top_k is not None and request.top_k < -1:
        raise InvalidRequestError(
            f"top_k must be -1, 0 (off) or positive, got {request.top_k}", "top_k"
        )
    if isinstance(request, ChatCompletionRequest):
        requested = request.max_completion_tokens
        param = "max_completion_tokens"
        if requested is None:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = _max_tokens(
            requested, param, None, prompt_len, model.max_model_len, prompt_param="messages"
        )
    else:
        max_tokens = _max_tokens(
            request.max_tokens,
            "max_tokens",
            DEFAULT_COMPLETION_MAX_TOKENS,
            prompt_len,
            model.max_model_len,
            prompt_param="prompt",
        )
    if not 0 <= request.min_tokens <= max_tokens:
        raise InvalidRequestError(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {request.min_tokens}",
            param="min_tokens",
        )
    stop_token_ids = tuple(request.stop_token_ids or ())
    _check_token_ids(list(stop_token_ids), model.vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=stop_token_ids,
        logit_bias=_logit_bias(request.logit_bias, model.vocab_size),
        logprobs=_requested_logprobs(request),
        structured_output=structured_output_spec(request),
    )


def detokenize_params(request: CompletionRequest | ChatCompletionRequest) -> DetokenizeParams:
    return DetokenizeParams(
        stop=_stop_strings(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
    )


def check_cache_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
