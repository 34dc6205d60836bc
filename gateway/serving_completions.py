"""POST /v1/completions: prompts in, text out, whole or as server-sent events."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from gateway.errors import error_body
from gateway.generation_stream import MultiGeneration
from gateway.logprobs_format import completion_logprobs
from gateway.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from gateway.serving_common import (
    SSE_DONE,
    Serving,
    build_engine_requests,
    collect_choices,
    new_request_id,
    sse_event,
    start_generation,
    usage_info,
)
from gateway.validation import Prompt, check_model, check_unsupported, completion_prompts
from services.errors import UnavailableError

logger = logging.getLogger(__name__)


@dataclass
class _StreamCursor:
    """Per-choice streaming state: the echo still to send and where the text has reached."""

    echo_text: str
    text_offset: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class CompletionServing(Serving):
    async def create_completion(self, request: CompletionRequest) -> Response:
        check_model(request.model, self._model_name)
        check_unsupported(request)
        prompts = await self._tokenizer.offload(
            completion_prompts, request, self._tokenizer, self._limits.max_prompts_per_request
        )
        request_id = new_request_id("cmpl")
        engine_requests = build_engine_requests(
            request_id, prompts, request, self._engine.model_info
        )
        logger.info(
            "request %s: %d prompt(s) x n=%d, stream=%s",
            request_id,
            len(prompts),
            request.n,
            request.stream,
        )
        generation = await start_generation(
            self._engine, engine_requests, self._metrics, self._model_name
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request_id, request, prompts, generation),
                media_type="text/event-stream",
            )
        try:
            return await self._respond(request_id, request, prompts, generation)
        finally:
            await generation.close()

    async def _respond(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[Prompt],
        generation: MultiGeneration,
    ) -> Response:
        results = await collect_choices(generation, len(prompts) * request.n)
        choices = []
        for index, result in enumerate(results):
            echo = prompts[index // request.n].text if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(result.logprobs, request.logprobs, len(echo))
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + result.text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                    stop_reason=result.stop_reason,
                )
            )
        usage = usage_info(
            prompts,
            [result.num_output_tokens for result in results],
            [results[p * request.n].num_cached_tokens for p in range(len(prompts))],
        )
        response = CompletionResponse(
            id=request_id, model=self._model_name, choices=choices, usage=usage
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[Prompt],
        generation: MultiGeneration,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        exclude = None if include_usage else {"usage"}
        cursors = [
            _StreamCursor(echo_text=prompts[index // request.n].text if request.echo else "")
            for index in range(len(prompts) * request.n)
        ]
        try:
            async for index, delta in generation.deltas():
                if delta.finish_reason == "error":
                    yield sse_event(
                        error_body(UnavailableError(delta.error or "generation failed"))
                    )
                    break
                cursor = cursors[index]
                cursor.num_output_tokens = delta.num_output_tokens
                cursor.num_cached_tokens = delta.num_cached_tokens
                text = cursor.echo_text + delta.text
                cursor.echo_text = ""
                if not text and not delta.finished and not delta.logprobs:
                    continue  # the detokenizer is holding text back (possible stop string)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(
                        delta.logprobs or [],
                        request.logprobs,
                        cursor.text_offset + len(text) - len(delta.text),
                    )
                cursor.text_offset += len(text)
                chunk = CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self._model_name,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason,
                        )
                    ],
                )
                yield sse_event(chunk, exclude=exclude)
            else:
                if include_usage:
                    usage = usage_info(
                        prompts,
                        [cursor.num_output_tokens for cursor in cursors],
                        [cursors[p * request.n].num_cached_tokens for p in range(len(prompts))],
                    )
                    final = CompletionStreamResponse(
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
