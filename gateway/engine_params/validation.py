"""Turn an API request into engine inputs, refusing with a 400 what the models cannot check.

The request models (gateway/openai/protocol.py) check each field on its own; here
are the rules that depend on the served model (vocabulary, context length,
name) or tie fields together. Each refusal is an ``InvalidRequestError`` whose
``param`` names the offending field, so clients see ``{"error": {"param":
"max_tokens", ...}}`` like OpenAI's. Limits follow OpenAI where it documents
one and vLLM otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.engine.client import ModelInfo
from kvmesh.gateway.engine_params.structured_outputs import structured_output_spec
from kvmesh.gateway.openai.protocol import (
    RESERVED_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from kvmesh.gateway.tokenizer import ChatTemplateError, Tokenizer
from kvmesh.gateway.tool_calling.prompt import messages_with_tools_in_text, tool_calls_for_template
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams

# OpenAI's default for /v1/completions; chat defaults to the room left in the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The smallest normal float32: sampling parameters travel as float32.
_FLOAT32_TINY = 1.1754943508222875e-38


def _positive_float32(value: float) -> float:
    """A parameter that must stay above 0 once it is a float32 on the wire.

    JSON allows 5e-324 for ``top_p`` ("> 0"), which is 0.0 as a float32 and was
    refused by the worker mid-request with a 503 (schemathesis, issue 43). Every
    value below the smallest float32 means the same there: for top_p the top
    token alone (its probability is at least 1/vocab), for repetition_penalty a
    ban of repeats.
    """
    return max(value, _FLOAT32_TINY)


@dataclass(frozen=True)
class Prompt:
    """One validated prompt: its token ids and, for echo, its text."""

    token_ids: list[int]
    text: str


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
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
            check_token_ids(item, tokenizer.vocab_size, "prompt")
            token_ids = list(item)
            text = tokenizer.decode(token_ids, skip_special_tokens=False)
        if not token_ids:
            # A string of characters the tokenizer drops (the schema cannot say which).
            raise InvalidRequestError("prompt has no tokens", param="prompt")
        prompts.append(Prompt(token_ids=token_ids, text=text))
    return prompts


def _message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""  # an assistant turn with tool calls only
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: plain dicts with string content."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        # Few templates know "developer"; OpenAI defines it as the new name of "system".
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _message_text(message),
        }
        for key in ("name", "tool_call_id"):
            value = getattr(message, key, None)
            if value is not None:
                entry[key] = value
        tool_calls = getattr(message, "tool_calls", None)
        if tool_calls:
            entry["tool_calls"] = tool_calls_for_template(tool_calls)
        rendered.append(entry)
    return rendered


def render_chat(
    messages: list[ChatMessage],
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The conversation as prompt text, through the model's own chat template.

    With ``tools``, a template that ignores them (renders the same text with and
    without) gets the tools and earlier calls written into the messages instead.
    ``continue_final_message`` (vLLM) leaves the last message open, so the model
    continues it rather than starting a new turn.
    """
    reserved = set(RESERVED_TEMPLATE_KWARGS).intersection(template_kwargs or {})
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    conversation = template_messages(messages)
    kwargs: dict[str, Any] = {
        **(template_kwargs or {}),
        "continue_final_message": continue_final_message,
    }
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
        request.continue_final_message,
    )
    # The template already wrote any BOS it wants.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if not token_ids:
        raise InvalidRequestError("messages rendered to an empty prompt", param="messages")
    return Prompt(token_ids=token_ids, text=text)


def truncate_prompts(
    prompts: list[Prompt],
    request: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
) -> list[Prompt]:
    """vLLM's truncate_prompt_tokens: keep each prompt's last k tokens (-1: max_model_len)."""
    k = request.truncate_prompt_tokens
    if k is None:
        return prompts
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or at most max_model_len={max_model_len}",
            param="truncate_prompt_tokens",
        )
    truncated = []
    for prompt in prompts:
        if len(prompt.token_ids) <= k:
            truncated.append(prompt)
            continue
        token_ids = prompt.token_ids[-k:]
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        truncated.append(Prompt(token_ids=token_ids, text=text))
    return truncated


def check_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse combinations of fields that are not implemented or not allowed together."""
    if (
        isinstance(request, CompletionRequest)
        and request.best_of is not None
        and request.best_of != request.n
    ):
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if request.stream and request.prompt_logprobs:
        # vLLM's rule: prompt logprobs ride on a whole response only (0 asks for nothing).
        raise InvalidRequestError(
            "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
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
    limit: int = 0,
) -> int:
    """The choice's max_tokens: as asked, or the default capped by ``limit``
    (``--max-tokens-limit``, 0: none) and the room the prompt leaves."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {prompt_len} tokens.",
            param=prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        # Not asked for: --max-tokens-limit caps the default quietly (vLLM caps its
        # default by the generation config's max_new_tokens the same way).
        if default is None:
            return min(room, limit) if limit else room
        requested = min(default, limit) if limit else default
    elif limit and requested > limit:
        raise InvalidRequestError(
            f"{param}={requested} is past this server's limit of {limit} tokens per choice "
            "(--max-tokens-limit)",
            param=param,
            code="max_tokens_limit_exceeded",
        )
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
        token_id = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                param="logit_bias",
            )
        bias.append((token_id, float(value)))
    return tuple(bias)


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _requested_prompt_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per prompt position the engine must compute, None for none.

    Completions' echo with logprobs shows the prompt's tokens with their
    logprobs (OpenAI), so it needs them too. A stream never carries vLLM's
    prompt_logprobs (check_unsupported refuses any above 0).
    """
    wanted = None if request.stream else request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        wanted = max(wanted or 0, request.logprobs)
    return wanted


def _requested_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, CompletionRequest):
        return request.logprobs
    # vLLM's rule: asking for alternatives needs logprobs; 0 asks for none.
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def _allowed_token_ids(
    request: CompletionRequest | ChatCompletionRequest, vocab_size: int
) -> tuple[int, ...]:
    if request.allowed_token_ids is None:
        return ()
    check_token_ids(request.allowed_token_ids, vocab_size, "allowed_token_ids")
    return tuple(request.allowed_token_ids)


def check_allowed_tokens_unconstrained(
    request: CompletionRequest | ChatCompletionRequest, structured: bool
) -> None:
    """Refuse allowed_token_ids together with a structured output (``structured``).

    Which tokens a grammar allows next is known only to the worker's grammar
    compiler, so the gateway cannot check that the two sets meet; when they do
    not, every token is masked and the request failed mid-generation with a
    503 (found by schemathesis against a real stack, issue 43). A 400 says why.
    """
    if structured and request.allowed_token_ids:
        raise InvalidRequestError(
            "allowed_token_ids cannot be combined with a structured output "
            "(guided_*, response_format, structured_outputs or a forced tool call)",
            param="allowed_token_ids",
        )


def bad_words_token_ids(
    words: list[str] | None, tokenizer: Tokenizer
) -> tuple[tuple[int, ...], ...]:
    """Each bad word as vLLM tokenizes it: as it reads at the start of a text, and
    after a space when that is a different first token of the same length."""
    sequences: list[tuple[int, ...]] = []
    for word in words or []:
        # Not empty: the model allows only words with a non-space character.
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequences)


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    model: ModelInfo,
    tokenizer: Tokenizer,
    max_tokens_limit: int = 0,
) -> SamplingParams:
    """The engine's sampling parameters for one prompt of ``request``
    (``max_tokens_limit``: ``--max-tokens-limit``, 0 for none)."""
    if isinstance(request, ChatCompletionRequest):
        requested = request.max_completion_tokens
        param = "max_completion_tokens"
        if requested is None:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = _max_tokens(
            requested,
            param,
            None,
            prompt_len,
            model.max_model_len,
            prompt_param="messages",
            limit=max_tokens_limit,
        )
    else:
        max_tokens = _max_tokens(
            request.max_tokens,
            "max_tokens",
            DEFAULT_COMPLETION_MAX_TOKENS,
            prompt_len,
            model.max_model_len,
            prompt_param="prompt",
            limit=max_tokens_limit,
        )
    if request.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens must be at most max_tokens={max_tokens}, got {request.min_tokens}",
            param="min_tokens",
        )
    stop_token_ids = tuple(request.stop_token_ids or ())
    check_token_ids(list(stop_token_ids), model.vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else _positive_float32(request.top_p),
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        top_n_sigma=request.top_n_sigma or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else _positive_float32(request.repetition_penalty),
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=stop_token_ids,
        logit_bias=_logit_bias(request.logit_bias, model.vocab_size),
        logprobs=_requested_logprobs(request),
        structured_output=structured_output_spec(request),
        prompt_logprobs=_requested_prompt_logprobs(request),
        allowed_token_ids=_allowed_token_ids(request, model.vocab_size),
        bad_words_token_ids=bad_words_token_ids(request.bad_words, tokenizer),
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
