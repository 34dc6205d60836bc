"""What the generating endpoints share: admission, fan-out, collection, usage, SSE framing."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.responses import Response

from kvmesh.gateway.engine.client import (
    EngineClient,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
)
from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.served_models import ServedModels
from kvmesh.gateway.engine_params.validation import (
    Prompt,
    check_allowed_tokens_unconstrained,
    check_cache_salt,
    check_unsupported,
    detokenize_params,
    sampling_params,
)
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.errors import error_body
from kvmesh.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    UsageInfo,
)
from kvmesh.gateway.request_cost import check_n, check_request_tokens
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.services.contracts.errors import UnavailableError
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import StructuredOutputSpec
from kvmesh.services.runtime.tracing import Tracing, span_or_nothing

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ServingContext:
    """What every OpenAI endpoint handler holds: the engine, tokenizer, name and metrics."""

    engine: EngineClient
    tokenizer: Tokenizer
    served_model_name: str
    metrics: GatewayMetrics
    limits: GatewayLimits
    models: ServedModels
    tracing: Tracing | None = None


class Serving:
    """An OpenAI endpoint handler; subclasses add the endpoints' own handlers."""

    def __init__(self, context: ServingContext) -> None:
        self._engine = context.engine
        self._models = context.models
        self._tokenizer = context.tokenizer
        self._model_name = context.served_model_name
        self._metrics = context.metrics
        self._limits = context.limits
        self._tracing = context.tracing

    async def _tokenize(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` (a template render, tokenization) on the tokenizer's thread,
        as the request's ``tokenize`` span when it is traced."""
        with span_or_nothing(self._tracing, "tokenize"):
            return await self._tokenizer.offload(work, *args)

    def _admit(self, request: CompletionRequest | ChatCompletionRequest) -> LoRARequest | None:
        """The request's adapter (404 for a model not served), after refusing (400) what
        no generation serves: checked before the prompts are tokenized or rendered."""
        lora_request = self._models.resolve(request.model)
        check_unsupported(request)
        check_n(request, self._limits)
        return lora_request

    def _answering_model(self, requested: str | None) -> str:
        """The model name a response carries: the one asked for, else the served name."""
        return requested or self._model_name

    async def _generate(
        self,
        engine_requests: list[GenerationRequest],
        stream: bool,
        events: Callable[[MultiGeneration], AsyncIterator[str]],
        respond: Callable[[MultiGeneration], Awaitable[Response]],
    ) -> Response:
        """Submit the engine requests, then answer with the server-sent ``events``
        (which close the generation when they end) or, without ``stream``, with
        the one body ``respond`` builds, closing the generation after it."""
        generation = await start_generation(
            self._engine, engine_requests, self._metrics, self._model_name
        )
        if stream:
            return StreamingResponse(events(generation), media_type="text/event-stream")
        try:
            return await respond(generation)
        finally:
            await generation.close()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse_event(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload)
    return f"data: {body}\n\n"


async def sse_stream(
    generation: MultiGeneration,
    chunks: Callable[[int, GenerationDelta], Iterable[str]],
    usage_chunk: Callable[[], BaseModel] | None,
    opening: Iterable[str] = (),
) -> AsyncIterator[str]:
    """A chat or completion stream: the ``opening`` events, each engine delta's
    ``chunks`` (its choice index and the delta), after the last delta the
    ``usage_chunk`` where the client asked for usage, then [DONE].

    A choice the engine failed ends the stream with an error event (and [DONE]);
    the generation is closed however the stream ends, a client gone included.
    """
    try:
        for event in opening:
            yield event
        async for index, delta in generation.deltas():
            if delta.finish_reason == "error":
                error = UnavailableError(delta.error or "generation failed")
                yield sse_event(error_body(error))
                break
            for event in chunks(index, delta):
                yield event
        else:
            if usage_chunk is not None:
                yield sse_event(usage_chunk())
        yield SSE_DONE
    finally:
        await generation.close()


def stream_usage_requested(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return request.stream_options is not None and request.stream_options.include_usage


def build_engine_requests(
    request_id: str,
    prompts: list[Prompt],
    request: CompletionRequest | ChatCompletionRequest,
    model: ModelInfo,
    tokenizer: Tokenizer,
    limits: GatewayLimits,
    structured_output: StructuredOutputSpec | None = None,
    lora_request: LoRARequest | None = None,
) -> list[GenerationRequest]:
    """One engine request per choice: choice ``p * n + i`` is sample ``i`` of prompt ``p``.

    Siblings carry the same prompt and one ``parallel_group``, so the scheduler
    computes the prompt's blocks once and shares them through its prefix cache.
    ``structured_output`` replaces the request's own constraint (forced tool calls).
    Refused (400) past ``limits``' token bounds before anything reaches the engine
    (callers check ``n`` before tokenizing).
    """
    check_cache_salt(request.cache_salt)
    detokenize = detokenize_params(request)
    per_prompt = [
        sampling_params(request, len(prompt.token_ids), model, tokenizer, limits.max_tokens_limit)
        for prompt in prompts
    ]
    check_request_tokens(
        [len(prompt.token_ids) for prompt in prompts],
        [params.max_tokens for params in per_prompt],
        request.n,
        limits,
    )
    engine_requests = []
    check_allowed_tokens_unconstrained(
        request, structured_output is not None or per_prompt[0].structured_output is not None
    )
    for prompt_index, (prompt, params) in enumerate(zip(prompts, per_prompt, strict=True)):
        if structured_output is not None:
            params = dataclasses.replace(params, structured_output=structured_output)
        group = f"{request_id}-p{prompt_index}" if request.n > 1 else None
        for sample in range(request.n):
            choice_index = prompt_index * request.n + sample
            engine_requests.append(
                GenerationRequest(
                    request_id=f"{request_id}-{choice_index}",
                    prompt_token_ids=prompt.token_ids,
                    sampling_params=params,
                    detokenize_params=detokenize,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    parallel_group=group,
                    lora_request=lora_request,
                )
            )
    return engine_requests


async def start_generation(
    engine: EngineClient,
    engine_requests: list[GenerationRequest],
    metrics: GatewayMetrics,
    model_name: str,
) -> MultiGeneration:
    """Submit every request and wait for admission; aborts all of them on refusal."""
    trackers = [metrics.track(model_name) for _ in engine_requests]
    generation = MultiGeneration(
        engine, engine_requests, on_delta=lambda index, delta: trackers[index].on_delta(delta)
    )
    try:
        await generation.start()
    except BaseException:
        await generation.close()
        raise
    return generation


@dataclass
class ChoiceResult:
    """One choice accumulated from its deltas (non-streaming responses)."""

    text: str = ""
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: GenerationDelta) -> None:
        self.text += delta.text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_output_tokens = delta.num_output_tokens
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def failure_error(delta: GenerationDelta) -> UnavailableError | None:
    """The error to answer with when a choice ended by failure rather than by stopping."""
    if delta.finish_reason == "error":
        return UnavailableError(delta.error or "the engine failed to generate")
    if delta.finish_reason == "abort":
        return UnavailableError(delta.error or "the engine aborted the request")
    return None


async def collect_choices(generation: MultiGeneration, num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(num_choices)]
    async for index, delta in generation.deltas():
        error = failure_error(delta)
        if error is not None:
            raise error
        results[index].add(delta)
    return results


def usage_info(
    prompts: list[Prompt], num_output_tokens: list[int], cached_per_choice: list[int]
) -> UsageInfo:
    """Usage of one API request; the two lists have one entry per choice.

    A prompt shared by n choices is counted once in ``prompt_tokens``, as OpenAI
    bills it, while ``cached_tokens`` adds up the prefix-cache hits of every
    sample: with n > 1 the first sample computes the prompt and its siblings
    are the ones that hit the cache, so counting one sample would hide them.
    """
    prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    completion_tokens = sum(num_output_tokens)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached_per_choice)),
    )
