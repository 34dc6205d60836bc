"""The detokenizer service: scheduler outputs in, per-gateway text deltas out.

It holds one StreamOutputs subscription to the scheduler. For each engine
step it advances every request's incremental detokenizer in one pass, asks
the scheduler (one FinishRequests call per step) to finish requests whose
stop string matched, and routes the deltas to the gateway that submitted each
request (by client_id), again one message per step.

Request migration: a header that carries ``output_token_ids`` (republished
after a detokenizer restart, or a continuation after a scheduler restart)
restarts the request's state from prompt + those tokens and the output says
``replay``: its text starts at the first output token, and the gateway skips
what it delivered already. Losing the scheduler stream drops every request's
state and tells each gateway ``scheduler_lost``, so that it resubmits them.

A gateway's subscription ending means the gateway is gone (or cut off): the
scheduler is asked to abort every request it submitted, which would otherwise
run to max_tokens for nobody. A gateway that falls ``_MAX_GATEWAY_BACKLOG``
step batches behind is cut off the same way (its stream ends with
RESOURCE_EXHAUSTED; it fails its requests and subscribes again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram

from kvmesh.detokenizer.registry import DetokenizerTable, StepInput
from kvmesh.detokenizer.request_tracing import DetokenizerRequestTraces
from kvmesh.protos import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvmesh.services.contracts.errors import OverloadedError
from kvmesh.services.contracts.step_codec import detokenize_params_from_proto
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel

logger = logging.getLogger(__name__)

_STEP_SECONDS = Histogram(
    "kvmesh:detokenizer_step_seconds",
    "time to detokenize one engine step's outputs",
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
_TOKENS = Counter("kvmesh:detokenizer_tokens_total", "token ids detokenized")
_LIVE = Gauge("kvmesh:detokenizer_live_requests", "requests with detokenizer state")
_STOPS = Counter("kvmesh:detokenizer_stop_string_matches_total", "requests ended by a stop string")

# Requests already ended by a stop string, whose in-flight tokens may still
# arrive from the scheduler; remembered so those are dropped quietly.
_MAX_REMEMBERED_STOPS = 65_536

# Step batches queued for one gateway before it is cut off as stuck.
_MAX_GATEWAY_BACKLOG = 4096


@dataclass
class GatewaySubscription:
    """One gateway's stream: its bounded queue, and whether it was cut off."""

    queue: asyncio.Queue[detokenizer_pb2.DetokenizedBatch]
    cut_off: bool = False


class DetokenizerEngine:
    def __init__(
        self,
        table: DetokenizerTable,
        scheduler_addr: str,
        security: InternalSecurity = NO_INTERNAL_AUTH,
        traces: DetokenizerRequestTraces | None = None,
    ) -> None:
        self.table = table
        self.scheduler_addr = scheduler_addr
        self._security = security
        self._client_of: dict[str, str] = {}
        self._num_output_tokens: dict[str, int] = {}
        self._stopped: OrderedDict[str, None] = OrderedDict()
        self._subscribers: dict[str, GatewaySubscription] = {}
        self.connected = False
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        # Fire-and-forget FinishRequests / AbortRequests calls, referenced until done.
        self._background: set[asyncio.Task[None]] = set()
        # Each traced request's span (--otlp-traces-endpoint; None: off).
        self.traces = traces

    # ---- gateway side ------------------------------------------------------

    def subscribe(self, client_id: str) -> GatewaySubscription:
        subscription = GatewaySubscription(asyncio.Queue(maxsize=_MAX_GATEWAY_BACKLOG))
        self._subscribers[client_id] = subscription
        return subscription

    def unsubscribe(self, client_id: str, subscription: GatewaySubscription) -> None:
        """The gateway's stream ended: unless it already subscribed again, it is gone."""
        if self._subscribers.get(client_id) is subscription:
            del self._subscribers[client_id]
            self._abort_client(client_id)

    def _abort_client(self, client_id: str) -> None:
        """Have the scheduler abort every request of a gone gateway."""
        if self._stub is None:
            return  # no scheduler stream: it aborts everything itself
        logger.warning("gateway %r is gone; aborting its requests", client_id)
        self._in_background(
            self._stub.AbortRequests(
                scheduler_pb2.AbortRequestsRequest(client_id=client_id), timeout=10
            ),
            f"abort the requests of gateway {client_id!r}",
        )

    def _in_background(self, call: Awaitable[object], what: str) -> None:
        async def run() -> None:
            try:
                await call
            except grpc.aio.AioRpcError as e:
                logger.warning("could not %s: %s", what, e.details())

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- scheduler side ----------------------------------------------------

    def process_step(
        self, step: scheduler_pb2.StepOutputs
    ) -> tuple[dict[str, list[detokenizer_pb2.DetokenizedOutput]], list[str]]:
        """Detokenize one step. Returns outputs per client_id and stop-string finishes."""
        inputs: list[StepInput] = []
        kept: list[scheduler_pb2.RequestOutput] = []
        replaying: set[str] = set()
        for out in step.outputs:
            rid = out.request_id
            if rid in self._stopped:
                if out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    self._stopped.pop(rid, None)
                continue
            replayed: list[int] = []
            if out.HasField("header"):
                replayed = list(out.header.output_token_ids)
                self._client_of[rid] = out.header.client_id
                if rid in self.table:  # republished while this detokenizer held it
                    self.table.remove(rid)
                # A header starts the request's state here: its text counts from
                # the first output token (for a fresh request, trivially).
                replaying.add(rid)
                if replayed:
                    self._num_output_tokens[rid] = 0
                try:
                    self.table.add(
                        rid,
                        list(out.header.prompt_token_ids),
                        detokenize_params_from_proto(out.header.detokenize_params),
                    )
                except Exception as e:
                    logger.warning("request %s: cannot start detokenizing: %s", rid, e)
                if self.traces is not None:
                    self.traces.on_header(rid, out.header)
            finished = out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            inputs.append(
                StepInput(
                    rid,
                    replayed + list(out.new_token_ids),
                    finished,
                    out.finish_reason == common_pb2.FINISH_REASON_STOP,
                )
            )
            kept.append(out)
        results = self.table.process_step(inputs)

        per_client: dict[str, list[detokenizer_pb2.DetokenizedOutput]] = {}
        stop_finishes: list[str] = []
        for out, step_input, result in zip(kept, inputs, results, strict=True):
            rid = out.request_id
            msg = detokenizer_pb2.DetokenizedOutput(
                request_id=rid,
                token_ids=step_input.new_token_ids,
                replay=rid in replaying,
                finish_reason=out.finish_reason,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                logprobs=out.logprobs,
                error=out.error,
                prompt_logprobs=out.prompt_logprobs,
                pooled_data=out.pooled_data,
            )
            if out.HasField("stop_token_id"):
                msg.stop_token_id = out.stop_token_id
            if result.error is not None:
                msg.finish_reason = common_pb2.FINISH_REASON_ERROR
                msg.error = f"detokenization failed: {result.error}"
                if out.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    stop_finishes.append(rid)  # stop generating for a broken request
            else:
                delta = result.delta
                msg.text = delta.text
                if delta.stop_string is not None and msg.finish_reason in (
                    common_pb2.FINISH_REASON_UNSPECIFIED,
                    common_pb2.FINISH_REASON_STOP,
                    common_pb2.FINISH_REASON_LENGTH,
                ):
                    msg.finish_reason = common_pb2.FINISH_REASON_STOP
                    msg.stop_string = delta.stop_string
                    if out.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                        stop_finishes.append(rid)
                        self._remember_stopped(rid)
                    _STOPS.inc()
            client = self._client_of.get(rid, "")
            msg.num_output_tokens = self._num_output_tokens.get(rid, 0) + len(msg.token_ids)
            self._num_output_tokens[rid] = msg.num_output_tokens
            if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._client_of.pop(rid, None)
                self._num_output_tokens.pop(rid, None)
                self.table.remove(rid)
                if self.traces is not None:
                    self.traces.on_finished(msg)
            per_client.setdefault(client, []).append(msg)
        _TOKENS.inc(sum(len(i.new_token_ids) for i in inputs))
        _LIVE.set(len(self.table))
        return per_client, stop_finishes

    def _remember_stopped(self, rid: str) -> None:
        self._stopped[rid] = None
        while len(self._stopped) > _MAX_REMEMBERED_STOPS:
            self._stopped.popitem(last=False)

    def _route(
        self, step_id: int, per_client: dict[str, list[detokenizer_pb2.DetokenizedOutput]]
    ) -> None:
        for client, outputs in per_client.items():
            subscription = self._subscribers.get(client)
            if subscription is None:
                logger.warning(
                    "no gateway %r subscribed; dropping %d outputs", client, len(outputs)
                )
                continue
            batch = detokenizer_pb2.DetokenizedBatch(step_id=step_id, outputs=outputs)
            try:
                subscription.queue.put_nowait(batch)
            except asyncio.QueueFull:
                logger.error(
                    "gateway %r is %d steps behind; cutting it off", client, _MAX_GATEWAY_BACKLOG
                )
                subscription.cut_off = True
                self.unsubscribe(client, subscription)

    def _announce_scheduler_lost(self) -> None:
        """Drop every request's state and tell every gateway to resubmit its requests.

        Every gateway, not only those with requests here: one whose requests
        still waited in the scheduler (no output yet) lost them too.
        """
        for rid in self._client_of:
            self.table.remove(rid)
        self._client_of.clear()
        self._num_output_tokens.clear()
        if self.traces is not None:
            self.traces.on_stream_lost()
        self._stopped.clear()
        lost = detokenizer_pb2.DetokenizedBatch(scheduler_lost=True)
        for client, subscription in list(self._subscribers.items()):
            try:
                subscription.queue.put_nowait(lost)
            except asyncio.QueueFull:
                subscription.cut_off = True
                self.unsubscribe(client, subscription)
        _LIVE.set(0)

    async def run(self, stop: asyncio.Event, on_connected) -> None:
        """Follow the scheduler's output stream, reconnecting when it breaks."""
        failures = 0
        was_connected = False
        while not stop.is_set():
            try:
                async with internal_channel(self.scheduler_addr, self._security) as channel:
                    self._stub = scheduler_pb2_grpc.SchedulerStub(channel)
                    stream = self._stub.StreamOutputs(
                        scheduler_pb2.StreamOutputsRequest(subscriber="detokenizer")
                    )
                    await stream.wait_for_connection()
                    self.connected = was_connected = True
                    failures = 0
                    await on_connected(True)
                    logger.info("subscribed to scheduler outputs at %s", self.scheduler_addr)
                    async for step in stream:
                        start = time.perf_counter()
                        per_client, stop_finishes = self.process_step(step)
                        self._route(step.step_id, per_client)
                        _STEP_SECONDS.observe(time.perf_counter() - start)
                        if stop_finishes and self._stub is not None:
                            self._in_background(
                                self._stub.FinishRequests(
                                    scheduler_pb2.FinishRequestsRequest(request_ids=stop_finishes),
                                    timeout=10,
                                ),
                                f"finish {stop_finishes} on the scheduler",
                            )
            except grpc.aio.AioRpcError as e:
                failures += 1
                # Quiet while the scheduler is still starting; loud once it was up.
                log = logger.warning if was_connected or failures % 20 == 0 else logger.debug
                log("scheduler stream broke: %s %s", e.code().name, e.details())
            except asyncio.CancelledError:
                raise
            finally:
                if self.connected:
                    self.connected = False
                    await on_connected(False)
                    self._announce_scheduler_lost()
                self._stub = None
            if not stop.is_set():
                await asyncio.sleep(0.5)


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, engine: DetokenizerEngine) -> None:
        self.engine = engine

    async def StreamDetokenized(
        self, request, context
    ) -> AsyncIterator[detokenizer_pb2.DetokenizedBatch]:
        subscription = self.engine.subscribe(request.client_id)
        # Headers now, so the gateway's wait_for_connection() returns at once.
        await context.send_initial_metadata(())
        logger.info("gateway %r subscribed", request.client_id)
        try:
            while True:
                batch = await subscription.queue.get()
                if subscription.cut_off:
                    raise OverloadedError(
                        f"fell {_MAX_GATEWAY_BACKLOG} steps behind; subscribe again"
                    )
                yield batch
        finally:
            self.engine.unsubscribe(request.client_id, subscription)
            logger.info("gateway %r unsubscribed", request.client_id)
