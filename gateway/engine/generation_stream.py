"""Run several engine requests as one stream of (choice index, delta).

A response with ``n`` choices, or a batch of prompts, becomes one engine
request per choice. ``MultiGeneration`` submits them all, waits until each has
either been admitted (its first delta arrived) or refused (``KvmeshError``),
and then merges their deltas in arrival order. Waiting for admission before
answering lets a full queue or a dead engine become a proper HTTP status
instead of an error in the middle of a 200 stream.

Whoever creates one must call ``close()`` (in a ``finally``): it aborts every
request that has not finished, which is how a client disconnect or a cancelled
handler frees the engine's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import anyio

from kvmesh.gateway.engine.client import EngineClient, GenerationDelta, GenerationRequest
from kvmesh.services.contracts.errors import KvmeshError

logger = logging.getLogger(__name__)

_END = object()  # a sub-stream ended without a final delta (engine bug); see _pump


class MultiGeneration:
    def __init__(
        self,
        engine: EngineClient,
        requests: list[GenerationRequest],
        on_delta: Callable[[int, GenerationDelta], None] | None = None,
    ) -> None:
        self._engine = engine
        self._requests = requests
        self._on_delta = on_delta
        # One item in hand per request: a slow reader leaves its deltas in the
        # engine client's bounded per-request queues, which fail it when full.
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException | object]] = (
            asyncio.Queue(maxsize=max(1, len(requests)))
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._admitted = [asyncio.Event() for _ in requests]
        self._admission_errors: list[BaseException | None] = [None] * len(requests)
        self._finished: set[int] = set()

    @property
    def request_ids(self) -> list[str]:
        return [request.request_id for request in self._requests]

    async def start(self) -> None:
        """Submit every request; raise the first refusal after aborting the others."""
        self._tasks = [
            asyncio.create_task(self._pump(index, request), name=f"generate-{request.request_id}")
            for index, request in enumerate(self._requests)
        ]
        await asyncio.gather(*(event.wait() for event in self._admitted))
        for error in self._admission_errors:
            if error is not None:
                raise error

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        try:
            async for delta in self._engine.generate(request):
                self._admitted[index].set()
                await self._queue.put((index, delta))
                if delta.finished:
                    return
            await self._queue.put((index, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._admitted[index].is_set():
                self._admission_errors[index] = exc
            await self._queue.put((index, exc))
        finally:
            self._admitted[index].set()

    async def deltas(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """Every delta of every request, each request's last one carrying finish_reason."""
        while len(self._finished) < len(self._requests):
            index, item = await self._queue.get()
            delta = item if isinstance(item, GenerationDelta) else self._failure_delta(index, item)
            if delta.finished:
                self._finished.add(index)
            if self._on_delta is not None:
                self._on_delta(index, delta)
            yield index, delta

    def _failure_delta(self, index: int, failure: object) -> GenerationDelta:
        request_id = self._requests[index].request_id
        if isinstance(failure, KvmeshError):
            message = failure.message
        elif isinstance(failure, BaseException):
            logger.error("request %s: engine stream failed", request_id, exc_info=failure)
            message = "the engine failed while generating"
        else:
            logger.error("request %s: engine stream ended without a finish reason", request_id)
            message = "the engine stream ended unexpectedly"
        return GenerationDelta(
            request_id=request_id,
            text="",
            token_ids=[],
            finish_reason="error",
            stop_reason=None,
            num_prompt_tokens=len(self._requests[index].prompt_token_ids),
            num_cached_tokens=0,
            num_output_tokens=0,
            logprobs=None,
            error=message,
        )

    async def close(self) -> None:
        """Abort unfinished requests and stop the pumps; safe to call while cancelled."""
        # Shielded: this runs in the finally of a handler that Starlette may be
        # cancelling because the client went away, which is exactly when the
        # abort must still reach the engine.
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            unfinished = [
                request.request_id
                for index, request in enumerate(self._requests)
                if index not in self._finished
            ]
            for request_id in unfinished:
                try:
                    await self._engine.abort(request_id)
                except Exception:
                    logger.exception("request %s: abort failed", request_id)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if unfinished:
                logger.info("aborted unfinished requests %s", unfinished)
