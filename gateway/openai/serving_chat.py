"""POST /v1/chat/completions: messages rendered by the model's chat template, text out.

With tools, gateway/tool_calling/plan.py decides how they are rendered and
whether the output is constrained (tool_choice "required" or a named
function) or parsed (the ``--tool-call-parser`` format for "auto"). With a
``--reasoning-parser``, the thinking comes back as ``reasoning_content`` and
only the answer after it is read for calls (gateway/openai/output_parsing.py). Calls
come back as ``tool_calls`` in the message, or in streamed deltas: each
call's id and name first, then its argument fragments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from kvmesh.gateway.engine.client import EngineClient, GenerationDelta
from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.served_models import ServedModels
from kvmesh.gateway.engine_params.structured_outputs import structured_output_spec
from kvmesh.gateway.engine_params.validation import (
    Prompt,
    chat_prompt,
    check_unsupported,
    truncate_prompts,
)
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.errors import error_body
from kvmesh.gateway.openai.logprobs_format import chat_logprobs, vllm_prompt_logprobs
from kvmesh.gateway.openai.output_parsing import OutputEvent, OutputParser, OutputParsing
from kvmesh.gateway.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from kvmesh.gateway.openai.serving_common import (
    SSE_DONE,
    Serving,
    build_engine_requests,
    collect_choices,
    new_request_id,
    sse_event,
    start_generation,
    usage_info,
)
from kvmesh.gateway.reasoning import ReasoningText
from kvmesh.gateway.request_cost import check_n
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.gateway.tool_calling.deltas import tool_call_delta, tool_call_models
from kvmesh.gateway.tool_calling.plan import ToolPlan, plan_tools
from kvmesh.services.contracts.errors import InvalidRequestError, UnavailableError
from kvmesh.services.runtime.tracing import Tracing

logger = logging.getLogger(__name__)


class ChatServing(Serving):
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        served_model_name: str,
        metrics: GatewayMetrics,
        limits: GatewayLimits,
        models: ServedModels,
        tracing: Tracing | None = None,
        output_parsing: OutputParsing | None = None,
    ) -> None:
        super().__init__(engine, tokenizer, served_model_name, metrics, limits, models, tracing)
        self._parsing = output_parsing or OutputParsing()

    def _parsers(
        self, request: ChatCompletionRequest, plan: ToolPlan, prompt: Prompt
    ) -> list[OutputParser]:
        return [
            self._parsing.parser(plan, prompt.text, request.chat_template_kwargs)
            for _ in range(request.n)
        ]

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        lora_request = self._models.resolve(request.model)
        check_unsupported(request)
        check_n(request, self._limits)  # before the chat is rendered
        plan = plan_tools(request, self._parsing.auto_tool_choice)
        if self._parsing.keeps_special_tokens(plan) and request.skip_special_tokens:
            # The format's markers are special tokens (vLLM's adjust_request does the same).
            request = request.model_copy(update={"skip_special_tokens": False})
        prompt = await self._tokenize(
            chat_prompt, request, self._tokenizer, plan.tools if plan.renders_tools else None
        )
        max_model_len = self._engine.model_info.max_model_len
        (prompt,) = truncate_prompts([prompt], request, self._tokenizer, max_model_len)
        request_id = new_request_id("chatcmpl")
        constraint = plan.constraint()
        if constraint is not None and structured_output_spec(request) is not None:
            raise InvalidRequestError(
                "a forced tool_choice cannot be combined with another structured output",
                param="tool_choice",
            )
        parsers = self._parsers(request, plan, prompt)
        constraint = self._parsing.after_reasoning(
            constraint or structured_output_spec(request), parsers[0], self._tokenizer
        )
        engine_requests = build_engine_requests(
            request_id,
            [prompt],
            request,
            self._engine.model_info,
            self._tokenizer,
            self._limits,
            structured_output=constraint,
            lora_request=lora_request,
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
                self._stream(request_id, request, prompt, generation, plan, parsers),
                media_type="text/event-stream",
            )
        try:
            return await self._respond(request_id, request, prompt, generation, parsers)
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
        parsers: list[OutputParser],
    ) -> Response:
        results = await collect_choices(generation, request.n)
        num_top = self._num_top_logprobs(request)
        choices = []
        for index, result in enumerate(results):
            parsed = parsers[index].parse(result.text)
            finish_reason = result.finish_reason
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(
                        content=parsed.content,
                        reasoning_content=parsed.reasoning,
                        tool_calls=tool_call_models(parsed.tool_calls),
                    ),
                    logprobs=(
                        None
                        if num_top is None
                        else chat_logprobs(
                            result.logprobs, num_top, request.return_tokens_as_token_ids
                        )
                    ),
                    finish_reason=finish_reason,
                    stop_reason=result.stop_reason,
                )
            )
        usage = usage_info(
            [prompt],
            [result.num_output_tokens for result in results],
            [result.num_cached_tokens for result in results],
        )
        prompt_logprobs = results[0].prompt_logprobs
        response = ChatCompletionResponse(
            id=request_id,
            model=request.model or self._model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=(
                None
                if prompt_logprobs is None
                else vllm_prompt_logprobs(prompt_logprobs, request.prompt_logprobs or 0)
            ),
        )
        return JSONResponse(response.model_dump())

    @staticmethod
    def _delta_messages(events: list[OutputEvent]) -> list[DeltaMessage]:
        """Deltas in generation order: consecutive thinking, or answer text, as one delta;
        each call's start (id, name) and argument fragments as deltas of their own, as
        OpenAI streams them."""
        deltas: list[DeltaMessage] = []
        for event in events:
            last = deltas[-1] if deltas else None
            if isinstance(event, ReasoningText):
                if last is not None and last.reasoning_content is not None:
                    last.reasoning_content += event.text
                else:
                    deltas.append(DeltaMessage(reasoning_content=event.text))
            elif isinstance(event, str):
                if last is not None and last.content is not None:
                    last.content += event
                else:
                    deltas.append(DeltaMessage(content=event))
            else:
                deltas.append(DeltaMessage(tool_calls=[tool_call_delta(event)]))
        return deltas

    def _parsed_stream_chunks(
        self,
        index: int,
        delta: GenerationDelta,
        logprobs: ChatLogprobs | None,
        parser: OutputParser,
    ) -> list[ChatStreamChoice]:
        """The engine delta through the parser; at the end, the finish reason.

        The engine delta's logprobs ride on the first chunk.
        """
        events = parser.feed(delta.text)
        if delta.finished:
            events += parser.finish()
        deltas = self._delta_messages(events)
        if logprobs is not None and not deltas:
            deltas.append(DeltaMessage())
        chunks = [
            ChatStreamChoice(index=index, delta=message, logprobs=logprobs if i == 0 else None)
            for i, message in enumerate(deltas)
        ]
        if delta.finished:
            finish_reason = delta.finish_reason
            if parser.called and finish_reason == "stop":
                finish_reason = "tool_calls"
            chunks.append(
                ChatStreamChoice(
                    index=index,
                    delta=DeltaMessage(),
                    finish_reason=finish_reason,
                    stop_reason=delta.stop_reason,
                )
            )
        return chunks

    async def _stream(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompt: Prompt,
        generation: MultiGeneration,
        plan: ToolPlan,
        parsers: list[OutputParser],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        exclude = None if include_usage else {"usage"}
        num_top = self._num_top_logprobs(request)
        num_output_tokens = [0] * request.n
        num_cached_tokens = [0] * request.n
        parsed = plan.mode != "none" or self._parsing.reasoning is not None

        def chunk(choice: ChatStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=request.model or self._model_name,
                choices=[choice],
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
                    yield sse_event(
                        error_body(UnavailableError(delta.error or "generation failed"))
                    )
                    break
                num_output_tokens[index] = delta.num_output_tokens
                num_cached_tokens[index] = delta.num_cached_tokens
                if not delta.text and not delta.finished and not delta.logprobs:
                    continue  # the detokenizer is holding text back (possible stop string)
                logprobs = None
                if num_top is not None and delta.logprobs:
                    logprobs = chat_logprobs(
                        delta.logprobs, num_top, request.return_tokens_as_token_ids
                    )
                if not parsed:
                    yield chunk(
                        ChatStreamChoice(
                            index=index,
                            delta=DeltaMessage(content=delta.text or None),
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason,
                        )
                    )
                    continue
                for event in self._parsed_stream_chunks(index, delta, logprobs, parsers[index]):
                    yield chunk(event)
            else:
                if include_usage:
                    usage = usage_info([prompt], num_output_tokens, num_cached_tokens)
                    final = ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=request.model or self._model_name,
                        choices=[],
                        usage=usage,
                    )
                    yield sse_event(final)
            yield SSE_DONE
        finally:
            await generation.close()
