"""POST /v1/chat/completions: messages rendered by the model's chat template, text out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from gateway.engine_client import EngineClient
from gateway.errors import error_body
from gateway.generation_stream import MultiGeneration
from gateway.logprobs_format import chat_logprobs
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from gateway.serving_common import (
    SSE_DONE,
    build_engine_requests,
    collect_choices,
    new_request_id,
    sse_event,
    start_generation,
    usage_info,
)
from gateway.tokenizer import Tokenizer
from gateway.validation import Prompt, chat_prompt, check_model, check_unsupported

logger = logging.getLogger(__name__)


class ChatServing:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        served_model_name: str,
        metrics: GatewayMetrics,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._model_name = served_model_name
        self._metrics = metrics

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        check_model(request.model, self._model_name)
        check_unsupported(request)
        prompt = chat_prompt(request, self._tokenizer)
        request_id = new_request_id("chatcmpl")
        engine_requests = build_engine_requests(
            request_id, [prompt], request, self._engine.model_info
        )
        logger.info(
            "request %s: chat, %d prompt tokens, n=%d, stream=%s",
            request_id,
            len(prompt.token_ids),
            request.n,
            request.stream,
        )
        generation = await start_generation(
            self._engine, engine_requests, self._metrics, self._model_name
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request_id, request, prompt, generation),
                media_type="text/event-stream",
            )
        try:
            return await self._respond(request_id, request, prompt, generation)
        finally:
            await generation.close()

    def _num_top_logprobs(self, request: ChatCompletionRequest) -> int | None:
        return (request.top_logprobs or 0) if request.logprobs else None

    async def _respond(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompt: Prompt,
        generation: MultiGeneration,
    ) -> Response:
        results = await collect_choices(generation, request.n)
        num_top = self._num_top_logprobs(request)
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content=result.text),
                logprobs=None if num_top is None else chat_logprobs(result.logprobs, num_top),
                finish_reason=result.finish_reason,
                stop_reason=result.stop_reason,
            )
            for index, result in enumerate(results)
        ]
        usage = usage_info(
            [prompt],
            [result.num_output_tokens for result in results],
            [results[0].num_cached_tokens],
        )
        response = ChatCompletionResponse(
            id=request_id, model=self._model_name, choices=choices, usage=usage
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompt: Prompt,
        generation: MultiGeneration,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        exclude = None if include_usage else {"usage"}
        num_top = self._num_top_logprobs(request)
        num_output_tokens = [0] * request.n
        num_cached_tokens = [0] * request.n

        def chunk(choice: ChatStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self._model_name, choices=[choice]
            )
            return sse_event(body, exclude=exclude)

        try:
            # OpenAI opens every choice with the assistant role and empty content.
            for index in range(request.n):
                yield chunk(
                    ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                )
            async for index, delta in generation.deltas():
                if delta.finish_reason == "error":
                    yield sse_event(error_body(delta.error or "generation failed", 503))
                    break
                num_output_tokens[index] = delta.num_output_tokens
                num_cached_tokens[index] = delta.num_cached_tokens
                if not delta.text and not delta.finished and not delta.logprobs:
                    continue  # the detokenizer is holding text back (possible stop string)
                logprobs = None
                if num_top is not None and delta.logprobs:
                    logprobs = chat_logprobs(delta.logprobs, num_top)
                yield chunk(
                    ChatStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=delta.text or None),
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                    )
                )
            else:
                if include_usage:
                    usage = usage_info([prompt], num_output_tokens, [num_cached_tokens[0]])
                    final = ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self._model_name,
                        choices=[],
                        usage=usage,
                    )
                    yield sse_event(final)
            yield SSE_DONE
        finally:
            await generation.close()
