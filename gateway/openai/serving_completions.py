"""POST /v1/completions: prompts in, text out, whole or as server-sent events."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvmesh.gateway.engine.client import GenerationDelta, TokenLogprob
from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.validation import (
    Prompt,
    completion_prompts,
    truncate_prompts,
)
from kvmesh.gateway.openai.logprobs_format import (
    completion_logprobs,
    concat_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from kvmesh.gateway.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptLogprobs,
)
from kvmesh.gateway.openai.serving_common import (
    Serving,
    build_engine_requests,
    collect_choices,
    new_request_id,
    sse_event,
    sse_stream,
    stream_usage_requested,
    usage_info,
)
from kvmesh.gateway.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _StreamCursor:
    """Per-choice streaming state: the echo still to send and where the text has reached."""

    echo_text: str
    text_offset: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


def _tokenized_prompts(
    request: CompletionRequest, tokenizer: Tokenizer, limits: GatewayLimits, max_model_len: int
) -> list[Prompt]:
    """The request's prompts tokenized, checked and truncated (on the tokenizer's thread)."""
    prompts = completion_prompts(request, tokenizer, limits.max_prompts_per_request)
    return truncate_prompts(prompts, request, tokenizer, max_model_len)


class CompletionServing(Serving):
    async def create_completion(self, request: CompletionRequest) -> Response:
        lora_request = self._admit(request)
        model_info = self._engine.model_info
        prompts = await self._tokenize(
            _tokenized_prompts, request, self._tokenizer, self._limits, model_info.max_model_len
        )
        request_id = new_request_id("cmpl")
        engine_requests = build_engine_requests(
            request_id,
            prompts,
            request,
            model_info,
            self._tokenizer,
            self._limits,
            lora_request=lora_request,
        )
        logger.info(
            "request %s: %d prompt(s) x n=%d, stream=%s",
            request_id,
            len(prompts),
            request.n,
            request.stream,
        )
        return await self._generate(
            engine_requests,
            request.stream,
            lambda generation: self._stream(request_id, request, prompts, generation),
            lambda generation: self._respond(request_id, request, prompts, generation),
        )

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
            prompt = prompts[index // request.n]
            echo = prompt.text if request.echo else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + result.text,
                    logprobs=self._logprobs(
                        request, prompt, result.prompt_logprobs, result.logprobs, len(echo)
                    ),
                    finish_reason=result.finish_reason,
                    stop_reason=result.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(request, result.prompt_logprobs),
                )
            )
        usage = usage_info(
            prompts,
            [result.num_output_tokens for result in results],
            [result.num_cached_tokens for result in results],
        )
        response = CompletionResponse(
            id=request_id, model=self._answering_model(request.model), choices=choices, usage=usage
        )
        return JSONResponse(response.model_dump())

    def _logprobs(
        self,
        request: CompletionRequest,
        prompt: Prompt,
        prompt_logprobs: list[TokenLogprob | None] | None,
        logprobs: list[TokenLogprob],
        text_offset: int,
    ) -> CompletionLogprobs | None:
        """OpenAI's columnar logprobs of the generated tokens, after the prompt's when echoed.

        ``prompt_logprobs`` is set only on the part of a choice that echoes the prompt.
        """
        if request.logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        generated = completion_logprobs(logprobs, request.logprobs, text_offset, as_ids)
        if not request.echo or prompt_logprobs is None:
            return generated
        echoed = echo_logprobs(
            prompt.token_ids,
            self._tokenizer.token_to_text(prompt.token_ids[0]),
            prompt_logprobs,
            request.logprobs,
            as_ids,
        )
        return concat_logprobs(echoed, generated)

    @staticmethod
    def _prompt_logprobs(
        request: CompletionRequest, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field: whenever they were computed, as vLLM answers."""
        if prompt_logprobs is None:
            return None
        num_top = request.prompt_logprobs
        if num_top is None:
            num_top = request.logprobs or 0
        return vllm_prompt_logprobs(prompt_logprobs, num_top)

    def _stream(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[Prompt],
        generation: MultiGeneration,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self._answering_model(request.model)
        include_usage = stream_usage_requested(request)
        exclude = None if include_usage else {"usage"}
        cursors = [
            _StreamCursor(echo_text=prompts[index // request.n].text if request.echo else "")
            for index in range(len(prompts) * request.n)
        ]

        def chunks(index: int, delta: GenerationDelta) -> Iterator[str]:
            cursor = cursors[index]
            cursor.num_output_tokens = delta.num_output_tokens
            cursor.num_cached_tokens = delta.num_cached_tokens
            echo = cursor.echo_text
            text = echo + delta.text
            cursor.echo_text = ""
            if not text and not delta.finished and not delta.logprobs:
                return  # the detokenizer is holding text back (possible stop string)
            logprobs = self._logprobs(
                request,
                prompts[index // request.n],
                delta.prompt_logprobs if echo else None,
                delta.logprobs or [],
                cursor.text_offset + len(echo),
            )
            cursor.text_offset += len(text)
            chunk = CompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
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

        def usage_chunk() -> CompletionStreamResponse:
            usage = usage_info(
                prompts,
                [cursor.num_output_tokens for cursor in cursors],
                [cursor.num_cached_tokens for cursor in cursors],
            )
            return CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage
            )

        return sse_stream(generation, chunks, usage_chunk if include_usage else None)
