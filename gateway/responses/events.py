"""A streamed response as OpenAI's typed server-sent events.

Each event is ``event: <type>`` plus its JSON with a ``sequence_number``
counting from 0. The stream opens with ``response.created`` and
``response.in_progress``, then for each output item in order:

- thinking (with ``--reasoning-parser``): ``response.output_item.added`` (a
  reasoning item), ``response.content_part.added`` (a reasoning_text part),
  ``response.reasoning_text.delta`` per piece, then ``response.reasoning_text.done``,
  ``response.content_part.done``, ``response.output_item.done``;
- text: ``response.output_item.added`` (a message), ``response.content_part.added``,
  ``response.output_text.delta`` per piece, then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``;
- a call: ``response.output_item.added`` (a function_call, arguments ""),
  ``response.function_call_arguments.delta`` per fragment, then
  ``response.function_call_arguments.done`` and ``response.output_item.done``;

and closes with ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it short), whose response holds every item. A
generation that fails midway sends an ``error`` event and ``response.failed``.
``ResponseEventWriter`` takes the output parser's events (thinking, content
strings, call starts, argument fragments) and keeps the item bookkeeping.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.gateway.openai.output_parsing import OutputEvent
from kvmesh.gateway.reasoning import ReasoningText
from kvmesh.gateway.responses.output import item_status, message_item, new_item_id, reasoning_item
from kvmesh.gateway.responses.protocol import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseObject,
)
from kvmesh.gateway.tool_calling.events import ToolCallArguments, ToolCallStart

OpenItem = OutputMessage | OutputFunctionCall | OutputReasoning


class ResponseEventWriter:
    """Turns parser events into SSE text; ``output`` is every item so far, open ones included."""

    def __init__(self) -> None:
        self._sequence_number = 0
        self.output: list[OutputItem] = []
        self._open: OpenItem | None = None

    def event(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload)}\n\n"

    def response_event(self, event_type: str, response: ResponseObject) -> str:
        return self.event(event_type, response=response.model_dump(mode="json", by_alias=True))

    @property
    def _output_index(self) -> int:
        return len(self.output) - 1

    def _item_event(self, event_type: str, item: OutputItem) -> str:
        return self.event(
            event_type, output_index=self._output_index, item=item.model_dump(mode="json")
        )

    def feed(self, events: list[OutputEvent]) -> list[str]:
        sse: list[str] = []
        for event in events:
            if isinstance(event, ReasoningText):
                sse += self._reasoning(event.text)
            elif isinstance(event, str):
                sse += self._text(event)
            elif isinstance(event, ToolCallStart):
                sse += self._close("completed")
                call = OutputFunctionCall(
                    id=new_item_id("fc"),
                    call_id=event.id,
                    name=event.name,
                    arguments="",
                    status="in_progress",
                )
                self.output.append(call)
                self._open = call
                sse.append(self._item_event("response.output_item.added", call))
            elif isinstance(event, ToolCallArguments) and isinstance(
                self._open, OutputFunctionCall
            ):
                self._open.arguments += event.text
                sse.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._open.id,
                        output_index=self._output_index,
                        delta=event.text,
                    )
                )
        return sse

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        sse: list[str] = []
        if not isinstance(self._open, OutputMessage):
            sse += self._close("completed")
            sse += self._open_message()
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        sse.append(
            self.event(
                "response.output_text.delta",
                item_id=self._open.id,
                output_index=self._output_index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return sse

    def _reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        sse: list[str] = []
        if not isinstance(self._open, OutputReasoning):
            sse += self._close("completed")
            item = reasoning_item("", "in_progress")
            self.output.append(item)
            self._open = item
            announced = OutputReasoning(id=item.id, status="in_progress", content=[])
            sse += [
                self._item_event("response.output_item.added", announced),
                self.event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=self._output_index,
                    content_index=0,
                    part=OutputReasoningText(text="").model_dump(mode="json"),
                ),
            ]
        assert isinstance(self._open, OutputReasoning)
        self._open.content[0].text += text
        sse.append(
            self.event(
                "response.reasoning_text.delta",
                item_id=self._open.id,
                output_index=self._output_index,
                content_index=0,
                delta=text,
            )
        )
        return sse

    def _open_message(self) -> list[str]:
        message = message_item("", "in_progress")
        self.output.append(message)
        self._open = message
        announced = OutputMessage(id=message.id, status="in_progress", content=[])
        return [
            self._item_event("response.output_item.added", announced),
            self.event(
                "response.content_part.added",
                item_id=message.id,
                output_index=self._output_index,
                content_index=0,
                part=OutputText(text="").model_dump(mode="json"),
            ),
        ]

    def _close(self, status: ItemStatus) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": self._output_index}
        if isinstance(item, OutputReasoning):
            thinking = item.content[0]
            return [
                self.event(
                    "response.reasoning_text.done", **where, content_index=0, text=thinking.text
                ),
                self.event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=thinking.model_dump(mode="json"),
                ),
                self._item_event("response.output_item.done", item),
            ]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            return [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=part.model_dump(mode="json"),
                ),
                self._item_event("response.output_item.done", item),
            ]
        return [
            self.event("response.function_call_arguments.done", **where, arguments=item.arguments),
            self._item_event("response.output_item.done", item),
        ]

    def finish(self, finish_reason: str | None) -> list[str]:
        """Close the open item; a generation with no output at all gets an empty message."""
        sse = [] if self.output else self._open_message()
        return sse + self._close(item_status(finish_reason))
