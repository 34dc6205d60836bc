"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request run as a chat.

The request becomes a chat completion request (conversation.py) that goes
through the chat path's own steps: tool planning, the chat template, prompt and
sampling validation, the engine fan-out, and the server's output parsing
(gateway/openai/output_parsing.py: ``--reasoning-parser``, ``--tool-call-parser``).
Its refusals name chat's fields, so they are renamed to the Responses fields
the client sent (``messages`` -> ``input``, ``max_completion_tokens`` ->
``max_output_tokens``, ...).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.validation import Prompt
from kvmesh.gateway.openai.output_parsing import OutputParser, OutputParsing
from kvmesh.gateway.openai.serving_chat_template import ChatTemplateServing
from kvmesh.gateway.openai.serving_common import ServingContext, collect_choices, failure_error
from kvmesh.gateway.responses.conversation import (
    ChatMessageDict,
    chat_request,
    input_messages,
    unparsed_tools,
)
from kvmesh.gateway.responses.events import ResponseEventWriter
from kvmesh.gateway.responses.output import (
    assistant_message,
    output_items,
    response_object,
    usage,
)
from kvmesh.gateway.responses.protocol import (
    DeletedResponse,
    OutputItem,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from kvmesh.gateway.responses.store import ResponseStore, StoredResponse
from kvmesh.gateway.tool_calling.plan import ToolPlan, plan_tools
from kvmesh.services.contracts.errors import InvalidRequestError, NotFoundError

logger = logging.getLogger(__name__)

# Chat's field names in refusals, as the Responses request spells them.
_PARAM_RENAMES = (
    (re.compile(r"^messages\b"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function\b"), r"tools.\1"),
)


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, replacement in _PARAM_RENAMES:
        renamed = pattern.sub(replacement, param)
        if renamed != param:
            return renamed
    return param


@contextmanager
def _as_responses_fields() -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        param = responses_param(exc.param)
        if param == exc.param:
            raise
        raise InvalidRequestError(exc.message, param=param, code=exc.code) from exc


def _status(finish_reason: str | None) -> ResponseStatus:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesServing(ChatTemplateServing):
    def __init__(
        self,
        context: ServingContext,
        store: ResponseStore,
        output_parsing: OutputParsing | None = None,
    ) -> None:
        super().__init__(context, output_parsing)
        self._store = store

    async def create_response(self, request: ResponsesRequest) -> Response:
        lora_request = self._models.resolve(request.model)
        history = await self._history(request.previous_response_id)
        response_id = f"resp_{uuid.uuid4().hex}"
        with _as_responses_fields():
            chat = chat_request(request, history)
            unparsed = unparsed_tools(request, self._parsing.auto_tool_choice)
            plan = plan_tools(chat, self._parsing.auto_tool_choice or unparsed)
            # Tools the server parses no calls for come back as text for the client to read.
            prepared = await self._prepare_chat(
                response_id,
                chat,
                plan,
                lora_request,
                parsed_plan=ToolPlan("none") if unparsed else plan,
                refuse_two_constraints=False,
            )
        prompt, (parser,) = prepared.prompt, prepared.parsers
        logger.info(
            "request %s: responses, %d prompt tokens, stream=%s, previous=%s",
            response_id,
            len(prompt.token_ids),
            request.stream,
            request.previous_response_id,
        )
        turn = _Turn(request, response_id, self._answering_model(request.model), history, prompt)
        return await self._generate(
            prepared.engine_requests,
            request.stream,
            lambda generation: self._stream(turn, generation, parser),
            lambda generation: self._respond(turn, generation, parser),
        )

    async def get_response(self, response_id: str) -> Response:
        entry = await self._store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(entry.response)

    async def delete_response(self, response_id: str) -> DeletedResponse:
        if not await self._store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)

    async def _history(self, previous_response_id: str | None) -> list[ChatMessageDict]:
        if previous_response_id is None:
            return []
        entry = await self._store.get(previous_response_id)
        if entry is None:
            raise _not_found(previous_response_id, "previous_response_id")
        return entry.messages

    async def _respond(
        self, turn: _Turn, generation: MultiGeneration, parser: OutputParser
    ) -> Response:
        (result,) = await collect_choices(generation, 1)
        output = output_items(parser.parse(result.text), result.finish_reason)
        response = turn.response(
            _status(result.finish_reason),
            output,
            response_usage=usage(
                len(turn.prompt.token_ids), result.num_cached_tokens, result.num_output_tokens
            ),
        )
        await self._keep(turn, response)
        return JSONResponse(response.model_dump(mode="json", by_alias=True))

    async def _stream(
        self, turn: _Turn, generation: MultiGeneration, parser: OutputParser
    ) -> AsyncIterator[str]:
        writer = ResponseEventWriter()
        try:
            yield writer.response_event("response.created", turn.response("in_progress", []))
            yield writer.response_event("response.in_progress", turn.response("in_progress", []))
            async for _, delta in generation.deltas():
                error = failure_error(delta)
                if error is not None:
                    logger.warning("request %s: failed while streaming: %s", turn.id, error)
                    failure = ResponseError(code="server_error", message=error.message)
                    yield writer.event(
                        "error", code=failure.code, message=failure.message, param=None
                    )
                    failed = turn.response("failed", writer.output, error=failure)
                    yield writer.response_event("response.failed", failed)
                    return
                events = parser.feed(delta.text)
                if delta.finished:
                    events += parser.finish()
                for sse in writer.feed(events):
                    yield sse
                if not delta.finished:
                    continue
                for sse in writer.finish(delta.finish_reason):
                    yield sse
                status = _status(delta.finish_reason)
                response = turn.response(
                    status,
                    writer.output,
                    response_usage=usage(
                        len(turn.prompt.token_ids), delta.num_cached_tokens, delta.num_output_tokens
                    ),
                )
                await self._keep(turn, response)
                done = "response.completed" if status == "completed" else "response.incomplete"
                yield writer.response_event(done, response)
        finally:
            await generation.close()

    async def _keep(self, turn: _Turn, response: ResponseObject) -> None:
        if not turn.request.store:
            return
        messages = [
            *turn.history,
            *input_messages(turn.request),
            assistant_message(response.output),
        ]
        entry = StoredResponse(response.model_dump(mode="json", by_alias=True), messages)
        await self._store.put(response.id, entry)


@dataclass(frozen=True)
class _Turn:
    """What one response is made of besides its output: request, id, model, history, prompt."""

    request: ResponsesRequest
    id: str
    model: str
    history: list[ChatMessageDict]
    prompt: Prompt
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        response_usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        return response_object(
            self.request,
            self.id,
            self.created_at,
            self.model,
            status,
            output,
            response_usage=response_usage,
            error=error,
        )


def _not_found(response_id: str, param: str) -> NotFoundError:
    return NotFoundError(
        f"no stored response with id {response_id!r} (never stored, deleted or expired)",
        param=param,
    )
