"""The gateway's EngineClient over gRPC: submit to the scheduler, read the detokenizer.

One StreamDetokenized subscription (keyed by this gateway's client_id)
carries the deltas of every request this gateway submitted; a dispatcher task
routes them to per-request queues. Requests outlive a restarting detokenizer
or scheduler (gateway/engine/migration.py): a broken stream is reconnected and the
scheduler asked to republish; a lost scheduler gets continuations. Only when
no detokenizer answers within ``--migration-timeout-s`` are the in-flight
requests failed with an error delta and aborted in the scheduler.

Bounds:

- At most ``_MAX_ADMISSIONS_IN_FLIGHT`` AddRequest calls are outstanding;
  more wait here. The scheduler admits on the loop that runs its steps, and
  thousands of concurrent calls starved that loop (issue 14: of 6,000 at once,
  1,047 ran past the 30 s deadline and got 503). A constrained request waits
  for its grammar compile inside AddRequest, so it takes no slot.
- A request whose reader falls ``_MAX_UNREAD_DELTAS`` deltas behind (a client
  that stopped reading its stream) is failed with an error and aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import grpc

from kvmesh.gateway.engine.client import (
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    PoolingInfo,
    TokenLogprob,
    TopLogprob,
)
from kvmesh.gateway.engine.disaggregation import PrefillClient
from kvmesh.gateway.engine.migration import MIGRATIONS, continuation_of, finish_reason_of_delivered
from kvmesh.gateway.engine.stream_cursor import StreamCursor
from kvmesh.gateway.tracing import TRACED_SCHEDULER_METHODS, current, note_delta, start_engine_span
from kvmesh.protos import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvmesh.services.contracts.errors import InvalidRequestError, UnavailableError, error_from_rpc
from kvmesh.services.contracts.finish_reason import finish_reason_from_proto
from kvmesh.services.contracts.step_codec import (
    detokenize_params_to_proto,
    lora_request_to_proto,
    sampling_params_to_proto,
)
from kvmesh.services.runtime.grpc_security import NO_INTERNAL_AUTH, InternalSecurity
from kvmesh.services.runtime.grpc_server import internal_channel
from kvmesh.services.runtime.tracing import Tracing

logger = logging.getLogger(__name__)

_MAX_ADMISSIONS_IN_FLIGHT = 32
_MAX_UNREAD_DELTAS = 1024
# Answers that mean "no scheduler can take it right now": a continuation retries them.
_RETRIABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
_RETRY_INTERVAL_S = 0.5


@dataclass(frozen=True)
class _Resubmit:
    """Queued for a request whose scheduler-side state is gone."""

    # The submission it replaces: a marker for an older one is stale.
    engine_id: str
    reason: str


@dataclass
class _LiveRequest:
    """A request between admission and its final delta, across its migrations."""

    first: scheduler_pb2.AddRequestRequest
    queue: asyncio.Queue[GenerationDelta | _Resubmit]
    # The id the engine knows it by now (a continuation gets a new one).
    engine_id: str
    cursor: StreamCursor = field(default_factory=StreamCursor)
    num_migrations: int = 0

    @property
    def request_id(self) -> str:
        return self.first.request_id


class GrpcEngineClient:
    def __init__(
        self,
        scheduler_addr: str,
        detokenizer_addr: str,
        token_text: Callable[[int], str],
        client_id: str | None = None,
        prefill: PrefillClient | None = None,
        security: InternalSecurity = NO_INTERNAL_AUTH,
        tracing: Tracing | None = None,
        max_migrations: int = 3,
        migration_timeout_s: float = 60.0,
    ) -> None:
        self.scheduler_addr = scheduler_addr
        self._security = security
        self.detokenizer_addr = detokenizer_addr
        self.client_id = client_id or f"gateway-{uuid.uuid4().hex[:12]}"
        self._token_text = token_text
        self._tracing = tracing
        self._scheduler_channel = internal_channel(
            scheduler_addr,
            security,
            tracing.client_interceptors(TRACED_SCHEDULER_METHODS) if tracing is not None else (),
        )
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        # Disaggregation: prompts are prefilled there first (gateway/engine/disaggregation.py).
        self._prefill = prefill
        # Live requests by the client's id and by the id the engine knows now.
        self._live: dict[str, _LiveRequest] = {}
        self._by_engine_id: dict[str, _LiveRequest] = {}
        self.max_migrations = max_migrations
        self.migration_timeout_s = migration_timeout_s
        self._subscribed = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._model_info: ModelInfo | None = None
        self._closing = False
        # Fire-and-forget aborts, referenced until done.
        self._background: set[asyncio.Future[None]] = set()
        self._admissions = asyncio.Semaphore(_MAX_ADMISSIONS_IN_FLIGHT)
        # Told False when the detokenizer stream breaks or the scheduler is lost,
        # True when the stream is back (the router re-probes at once; None: nobody).
        self.on_connection_change: Callable[[bool], None] | None = None

    def _connection_changed(self, up: bool) -> None:
        if self.on_connection_change is not None:
            self.on_connection_change(up)

    async def start(self, timeout: float = 600.0) -> None:
        """Fetch model info from the scheduler and subscribe to the detokenizer."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                info = await self._scheduler.GetInfo(
                    scheduler_pb2.GetSchedulerInfoRequest(), timeout=5, wait_for_ready=True
                )
                break
            except grpc.aio.AioRpcError as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise UnavailableError(f"scheduler unreachable: {e.details()}") from e
                await asyncio.sleep(0.5)
        self._model_info = ModelInfo(
            served_model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            capacity=info.max_num_seqs + info.max_waiting_requests,
            kv_block_size=info.block_size,
            dtype=info.dtype,
            dtype_reason=info.dtype_reason,
            quantization=info.quantization,
            pooling=(
                PoolingInfo(
                    tasks=tuple(info.pooling_tasks),
                    embedding_dim=info.embedding_dim,
                    matryoshka_dimensions=tuple(info.matryoshka_dimensions),
                    labels=tuple(info.labels),
                )
                if info.runner == "pooling"
                else None
            ),
            weight_bytes=info.weight_bytes or None,
            batch_invariant=info.batch_invariant,
        )
        self._dispatcher = asyncio.create_task(self._dispatch_forever(), name="detok-dispatch")
        await asyncio.wait_for(
            self._subscribed.wait(), timeout=max(1.0, deadline - asyncio.get_running_loop().time())
        )

    async def close(self) -> None:
        self._closing = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        await self._scheduler_channel.close()
        if self._prefill is not None:
            await self._prefill.close()

    @property
    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            raise UnavailableError("engine client not started")
        return self._model_info

    # ---- outputs -----------------------------------------------------------

    def _to_delta(
        self, out: detokenizer_pb2.DetokenizedOutput, live: _LiveRequest
    ) -> GenerationDelta | None:
        """The reader's delta: only what it has not received (None: nothing new)."""
        stop_reason: int | str | None = None
        which = out.WhichOneof("stop_reason")
        if which == "stop_token_id":
            stop_reason = out.stop_token_id
        elif which == "stop_string":
            stop_reason = out.stop_string
        logprobs = None
        if len(out.logprobs):
            logprobs = [self._token_logprob(lp) for lp in out.logprobs]
        reason = finish_reason_from_proto(out.finish_reason)
        finish_reason = None if reason is None else reason.value
        new = live.cursor.advance(out.text, list(out.token_ids), logprobs, out.replay)
        if out.replay and not (new.text or new.token_ids or finish_reason):
            return None  # a replay up to what the reader has
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if len(out.prompt_logprobs) and new.first:
            # Entry 0 is the first prompt token, which has no logprob.
            prompt_logprobs = [None]
            prompt_logprobs += [
                None if lp.token_id < 0 else self._token_logprob(lp) for lp in out.prompt_logprobs
            ]
        return GenerationDelta(
            request_id=live.request_id,
            text=new.text,
            token_ids=new.token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(live.first.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=len(live.cursor.token_ids),
            logprobs=new.logprobs,
            error=out.error or None,
            prompt_logprobs=prompt_logprobs,
            pooled_data=out.pooled_data or None,
        )

    def _token_logprob(self, lp: common_pb2.TokenLogprobs) -> TokenLogprob:
        return TokenLogprob(
            token_id=lp.token_id,
            token=self._token_text(lp.token_id),
            logprob=lp.logprob,
            top_logprobs=[
                TopLogprob(token_id=t, token=self._token_text(t), logprob=v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
            rank=lp.rank,
        )

    @staticmethod
    def _final(live: _LiveRequest, finish_reason: str, error: str | None = None) -> GenerationDelta:
        """A last delta made up here (an error, or an end the engine's output lost)."""
        return GenerationDelta(
            request_id=live.request_id,
            text="",
            token_ids=[],
            finish_reason=finish_reason,
            stop_reason=None,
            num_prompt_tokens=len(live.first.prompt_token_ids),
            num_cached_tokens=0,
            num_output_tokens=len(live.cursor.token_ids),
            logprobs=None,
            error=error,
        )

    def _forget(self, live: _LiveRequest) -> None:
        if self._live.get(live.request_id) is live:
            del self._live[live.request_id]
        if self._by_engine_id.get(live.engine_id) is live:
            del self._by_engine_id[live.engine_id]

    def _fail(self, live: _LiveRequest, reason: str) -> None:
        """End a request for its reader with an error (ahead of anything unread)."""
        self._forget(live)
        queue = live.queue
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(self._final(live, "error", reason))

    def _fail_all(self, reason: str) -> None:
        lives = list(self._live.values())
        for live in lives:
            self._fail(live, reason)
        if lives:
            # Their outputs could no longer reach this gateway: stop computing them.
            self._in_background(self._abort_many([live.engine_id for live in lives]))

    def _resubmit_all(self, reason: str, engine_ids: list[str] | None = None) -> None:
        """Have these requests (default: all) resubmitted as continuations by their readers."""
        ids = list(self._by_engine_id) if engine_ids is None else engine_ids
        for engine_id in ids:
            live = self._by_engine_id.get(engine_id)
            if live is None:
                continue
            # A full queue: its reader is failing for being too far behind anyway.
            with contextlib.suppress(asyncio.QueueFull):
                live.queue.put_nowait(_Resubmit(engine_id, reason))

    def fail_in_flight(self, reason: str) -> None:
        """End every request in flight with an error, and abort them on the scheduler."""
        self._fail_all(reason)

    def _deliver(self, out: detokenizer_pb2.DetokenizedOutput) -> None:
        live = self._by_engine_id.get(out.request_id)
        if live is None:
            return  # finished, aborted, failed or resubmitted here already
        delta = self._to_delta(out, live)
        if delta is None:
            return
        try:
            live.queue.put_nowait(delta)
        except asyncio.QueueFull:
            logger.warning(
                "request %s: reader %d deltas behind; failing it",
                live.request_id,
                live.queue.qsize(),
            )
            self._fail(live, f"the client fell {_MAX_UNREAD_DELTAS} steps behind")
            self._in_background(self._abort_many([live.engine_id]))

    async def _dispatch_forever(self) -> None:
        lost_since: float | None = None  # when the stream broke with requests live
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                async with internal_channel(self.detokenizer_addr, self._security) as channel:
                    stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
                    stream = stub.StreamDetokenized(
                        detokenizer_pb2.StreamDetokenizedRequest(client_id=self.client_id)
                    )
                    await stream.wait_for_connection()
                    self._subscribed.set()
                    self._connection_changed(True)
                    logger.info(
                        "subscribed to detokenizer %s as %s", self.detokenizer_addr, self.client_id
                    )
                    if lost_since is not None:
                        lost_since = None
                        for live in self._live.values():
                            live.cursor.await_replay()
                        self._in_background(self._resync())
                    async for batch in stream:
                        if batch.scheduler_lost:
                            logger.warning("the scheduler was lost; resuming live requests")
                            self._connection_changed(False)
                            self._resubmit_all("scheduler lost")
                        for out in batch.outputs:
                            self._deliver(out)
            except grpc.aio.AioRpcError as e:
                log = logger.warning if self._subscribed.is_set() else logger.debug
                log("detokenizer stream broke: %s %s", e.code().name, e.details())
            if self._subscribed.is_set():
                self._connection_changed(False)
            self._subscribed.clear()
            # Live requests wait (paused) for a detokenizer, for a while.
            if lost_since is None:
                lost_since = loop.time()
            if loop.time() - lost_since > self.migration_timeout_s:
                self._fail_all("detokenizer unavailable")
            if not self._live:
                lost_since = None
            if not self._closing:
                await asyncio.sleep(_RETRY_INTERVAL_S)

    async def _resync(self) -> None:
        """After subscribing to a new detokenizer: have the live requests republished;
        those the scheduler no longer holds are resubmitted as continuations."""
        ids = list(self._by_engine_id)
        if not ids:
            return
        try:
            reply = await self._pick_scheduler().ResyncRequests(
                scheduler_pb2.ResyncRequestsRequest(request_ids=ids), timeout=10
            )
            unknown = list(reply.unknown_ids)
        except grpc.aio.AioRpcError as e:
            logger.warning("resync failed (%s); resubmitting %d requests", e.details(), len(ids))
            unknown = ids
        logger.info("resynced %d live requests (%d resubmitted)", len(ids), len(unknown))
        self._resubmit_all("not held by the scheduler at resync", unknown)

    # ---- EngineClient ------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if not self._subscribed.is_set():
            raise UnavailableError("engine unavailable: not subscribed to the detokenizer")
        rid = request.request_id
        if rid in self._live:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        finished = False
        span = start_engine_span(self._tracing, rid)
        msg = scheduler_pb2.AddRequestRequest(
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_proto(request.sampling_params),
            detokenize_params=detokenize_params_to_proto(request.detokenize_params),
            priority=request.priority,
            client_id=self.client_id,
        )
        if request.cache_salt is not None:
            msg.cache_salt = request.cache_salt
        if request.parallel_group is not None:
            msg.parallel_group = request.parallel_group
        if request.lora_request is not None:
            msg.lora_request.CopyFrom(lora_request_to_proto(request.lora_request))
        # Two slots more than the bound: room for the error that ends an
        # overflow and for a resubmission marker.
        live = _LiveRequest(msg, asyncio.Queue(maxsize=_MAX_UNREAD_DELTAS + 2), rid)
        self._live[rid] = self._by_engine_id[rid] = live
        try:
            try:
                # The calls that carry the request on carry its trace too.
                with current(span):
                    # The prefill replica runs the base model only: adapter
                    # prompts are computed where they decode.
                    if self._prefill is not None and request.lora_request is None:
                        try:
                            transfer = await self._prefill_for(msg)
                        except asyncio.CancelledError:
                            finished = True  # _abandon_prefill aborts what it admits
                            raise
                        if transfer is not None:
                            msg.kv_transfer.CopyFrom(transfer)
                    if msg.HasField("kv_transfer"):
                        # Not cancelled midway: a transfer's leases end only where
                        # the decode replica holds them (until it runs or is aborted).
                        admission = asyncio.ensure_future(self._admit(msg))
                        try:
                            await asyncio.shield(admission)
                        except asyncio.CancelledError:
                            finished = True  # aborted once admitted, not before
                            self._in_background(self._abort_once_admitted(admission, rid))
                            raise
                    else:
                        await self._admit(msg)
            except grpc.aio.AioRpcError as e:
                finished = True  # never admitted: nothing to abort
                raise error_from_rpc(e) from e
            while True:
                item = await live.queue.get()
                delta = await self._resubmit(live, item) if isinstance(item, _Resubmit) else item
                if delta is None:
                    continue
                note_delta(span, delta)
                if delta.finished:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self._forget(live)
            if not finished:
                # The consumer went away (client disconnect, cancellation).
                self._in_background(self._abort_many([live.engine_id]))
            if span is not None:
                span.end()

    async def _resubmit(self, live: _LiveRequest, marker: _Resubmit) -> GenerationDelta | None:
        """Resume a request whose scheduler-side state is gone as a continuation.

        Returns a final delta when it cannot (or need not) continue, else None
        (its deltas follow from the scheduler that took it).
        """
        if marker.engine_id != live.engine_id:
            return None  # already resubmitted since
        info = self.model_info
        delivered = live.cursor.token_ids
        done = finish_reason_of_delivered(
            live.first, delivered, info.eos_token_ids, info.max_model_len
        )
        if done is not None:
            return self._final(live, done)  # only its last output was lost
        if live.num_migrations >= self.max_migrations:
            return self._final(
                live,
                "error",
                f"{marker.reason}: the request was migrated {live.num_migrations} times "
                f"(--max-migrations {self.max_migrations}), giving up",
            )
        live.num_migrations += 1
        self._by_engine_id.pop(live.engine_id, None)
        self._in_background(self._abort_many([live.engine_id]))  # if it lives on somewhere
        msg = continuation_of(live.first, delivered, live.num_migrations)
        live.engine_id = msg.request_id
        self._by_engine_id[live.engine_id] = live
        MIGRATIONS.labels("scheduler").inc()
        logger.warning(
            "request %s: %s; resubmitted as %s after %d tokens",
            live.request_id,
            marker.reason,
            live.engine_id,
            len(delivered),
        )
        deadline = asyncio.get_running_loop().time() + self.migration_timeout_s
        while True:
            try:
                await self._admit(msg)
                return None
            except grpc.aio.AioRpcError as e:
                if e.code() not in _RETRIABLE or asyncio.get_running_loop().time() > deadline:
                    return self._final(
                        live, "error", f"{marker.reason}; could not resume: {e.details()}"
                    )
            await asyncio.sleep(_RETRY_INTERVAL_S)

    def _pick_scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        """The scheduler a submission goes to (one today; a router picks among replicas)."""
        return self._scheduler

    async def _admit(self, msg: scheduler_pb2.AddRequestRequest) -> None:
        scheduler = self._pick_scheduler()
        if msg.sampling_params.HasField("structured_output"):
            await scheduler.AddRequest(msg, timeout=30)
            return
        async with self._admissions:
            await scheduler.AddRequest(msg, timeout=30)

    async def _prefill_for(
        self, msg: scheduler_pb2.AddRequestRequest
    ) -> scheduler_pb2.KVTransferParams | None:
        """The prefill replica's transfer for ``msg``; if the caller goes away
        meanwhile, the call is abandoned, not cancelled (gateway/engine/disaggregation.py)."""
        assert self._prefill is not None
        call = asyncio.ensure_future(self._prefill.prefill(msg))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._in_background(self._abandon_prefill(call, msg))
            raise

    async def _abandon_prefill(
        self,
        call: asyncio.Future[scheduler_pb2.KVTransferParams | None],
        msg: scheduler_pb2.AddRequestRequest,
    ) -> None:
        """Abort a prefill nobody waits for; if its transfer still comes, hand it
        to the decode replica and abort it there, which ends its leases."""
        assert self._prefill is not None
        if not call.done():
            await self._prefill.abort(msg.request_id)
        transfer = await call
        if transfer is None or not transfer.lease_ids:
            return
        msg.kv_transfer.CopyFrom(transfer)
        admission = asyncio.ensure_future(self._admit(msg))
        await self._abort_once_admitted(admission, msg.request_id)

    async def _abort_once_admitted(self, admission: asyncio.Future[None], request_id: str) -> None:
        """Abort ``request_id`` after its admission settled: an abort that overtook
        the AddRequest would find nothing and leave the request running."""
        try:
            await admission
        except grpc.aio.AioRpcError:
            return  # refused: nothing admitted (a refusal ends the transfer's leases)
        await self._abort_many([request_id])

    def _in_background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        await self._abort_many([live.engine_id if live is not None else request_id])

    async def _abort_many(self, request_ids: list[str]) -> None:
        try:
            await self._scheduler.AbortRequests(
                scheduler_pb2.AbortRequestsRequest(request_ids=request_ids), timeout=10
            )
        except grpc.aio.AioRpcError as e:
            logger.warning("requests %s: abort failed: %s", request_ids, e.details())

    async def check_ready(self) -> None:
        if not self._subscribed.is_set():
            raise UnavailableError("not subscribed to the detokenizer")
        try:
            await self._scheduler.CheckReady(scheduler_pb2.CheckReadyRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            raise UnavailableError(f"engine not ready: {e.details() or e.code().name}") from e
