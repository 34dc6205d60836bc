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
from collections.abc import AsyncIterator, Iterator

from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvmesh.gateway.engine.client import GenerationDelta
from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.validation import Prompt
from kvmesh.gateway.openai.logprobs_format import chat_logprobs, vllm_prompt_logprobs
from kvmesh.gateway.openai.output_parsing import OutputEvent, OutputParser
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
from kvmesh.gateway.openai.serving_chat_template import ChatTemplateServing
from kvmesh.gateway.openai.serving_common import (
    collect_choices,
    new_request_id,
    sse_event,
    sse_stream,
    stream_usage_requested,
    usage_info,
)
from kvmesh.gateway.reasoning import ReasoningText
from kvmesh.gateway.tool_calling.deltas import tool_call_delta, tool_call_models
from kvmesh.gateway.tool_calling.plan import ToolPlan, plan_tools

logger = logging.getLogger(__name__)


class ChatServing(ChatTemplateServing):
    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        lora_request = self._admit(request)  # before the chat is rendered
        plan = plan_tools(request, self._parsing.auto_tool_choice)
        request_id = new_request_id("chatcmpl")
        prepared = await self._prepare_chat(request_id, request, plan, lora_request)
        request, prompt, parsers = prepared.request, prepared.prompt, prepared.parsers
        logger.info(
            "request %s: chat, %d prompt tokens, n=%d, stream=%s",
            request_id,
            len(prompt.token_ids),
            request.n,
            request.stream,
        )
        return await self._generate(
            prepared.engine_requests,
            request.stream,
            lambda generation: self._stream(request_id, request, prompt, generation, plan, parsers),
            lambda generation: self._respond(request_id, request, prompt, generation, parsers),
        )

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
            model=self._answering_model(request.model),
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

    def _stream(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompt: Prompt,
        generation: MultiGeneration,
        plan: ToolPlan,
        parsers: list[OutputParser],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self._answering_model(request.model)
        include_usage = stream_usage_requested(request)
        exclude = None if include_usage else {"usage"}
        num_top = self._num_top_logprobs(request)
        num_output_tokens = [0] * request.n
        num_cached_tokens = [0] * request.n
        parsed = plan.mode != "none" or self._parsing.reasoning is not None

        def chunk(choice: ChatStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice]
            )
            return sse_event(body, exclude=exclude)

        def chunks(index: int, delta: GenerationDelta) -> Iterator[str]:
            num_output_tokens[index] = delta.num_output_tokens
            num_cached_tokens[index] = delta.num_cached_tokens
            if not delta.text and not delta.finished and not delta.logprobs:
                return  # the detokenizer is holding text back (possible stop string)
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
                return
            for event in self._parsed_stream_chunks(index, delta, logprobs, parsers[index]):
                yield chunk(event)

        def usage_chunk() -> ChatCompletionStreamResponse:
            usage = usage_info([prompt], num_output_tokens, num_cached_tokens)
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage
            )

        # OpenAI opens every choice with the assistant role and empty content.
        opening = (
            chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            for index in range(request.n)
        )
        return sse_stream(generation, chunks, usage_chunk if include_usage else None, opening)
