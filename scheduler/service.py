"""The scheduler service: gRPC front, the engine step loop, and output fan-out.

All scheduler state lives on one asyncio loop, so the pure-Python core
(kvmesh.scheduler.scheduler.Scheduler) needs no locks. With ``async_scheduling`` the
loop keeps one step in flight ahead: it schedules and sends step n+1, then
waits for step n's result, so the worker never idles while the scheduler
updates, publishes and schedules; with micro-batches (pipeline parallelism)
it keeps one step per stage in flight. Control calls that arrive
while a step is in flight (aborts, stop-string finishes) are queued and
applied between steps, so ``update_from_output`` never sees a request vanish
under it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable

from kvmesh.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.kv_leases import HeldLeases, StoreLeases
from kvmesh.scheduler.kv_lookup import StorePrefixLookup
from kvmesh.scheduler.lora_admission import request_lora
from kvmesh.scheduler.metrics import SchedulerMetrics
from kvmesh.scheduler.output import RequestOutput
from kvmesh.scheduler.prefill import PrefillRunner
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.request_tracing import SchedulerRequestTraces
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.scheduler.worker_client import WorkerClient
from kvmesh.services.contracts.errors import InvalidRequestError, OverloadedError, UnavailableError
from kvmesh.services.contracts.finish_reason import FinishReason, finish_reason_to_proto
from kvmesh.services.contracts.kv_cache_groups import windows_from_wire
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.contracts.step_codec import logprobs_to_proto, sampling_params_from_proto
from kvmesh.services.contracts.step_deadline import StepDeadline

logger = logging.getLogger(__name__)

# A prompt position the worker never scored (cannot happen while the scheduler
# skips prefix hits for such requests; kept so the list stays positional).
_UNSCORED = common_pb2.TokenLogprobs(token_id=-1)

# How often an otherwise idle loop asks the worker whether KV loads finished.
_LOAD_POLL_INTERVAL_S = 0.002

# Outputs queued for one subscriber before it is considered stuck and dropped.
_MAX_SUBSCRIBER_BACKLOG = 10_000


class SchedulerEngine:
    """Owns the core scheduler, the worker stream and the step loop."""

    def __init__(
        self,
        config: SchedulerConfig,
        worker: WorkerClient,
        eos_token_ids: list[int],
        metrics: SchedulerMetrics,
        max_waiting_requests: int,
        kv_lookup: StorePrefixLookup | None = None,
        step_deadline: StepDeadline | None = None,
        kv_leases: StoreLeases | None = None,
        traces: SchedulerRequestTraces | None = None,
        max_migrations: int = 3,
        subscriber_grace_s: float = 60.0,
    ) -> None:
        self.config = config
        self.core = Scheduler(config)
        # Asks the kvstore what it holds of each new prompt (KV connector on).
        self.kv_lookup = kv_lookup if self.core.connector is not None else None
        self.worker = worker
        self.eos_token_ids = frozenset(eos_token_ids)
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        # Headers not yet sent (they leave with a request's first output), and
        # those sent, kept while the request lives to be republished on resync.
        self._headers: dict[str, scheduler_pb2.RequestHeader] = {}
        self._sent_headers: dict[str, scheduler_pb2.RequestHeader] = {}
        # Requests to republish from their first token (ResyncRequests).
        self._pending_replays: set[str] = set()
        # A request lost with this many workers more than this fails (poison).
        self.max_migrations = max_migrations
        # How long the loop pauses for a detokenizer before aborting everything.
        self.subscriber_grace_s = subscriber_grace_s
        self._no_subscriber_since: float | None = None
        # Live request -> the client_id of the gateway that submitted it.
        self._client_of: dict[str, str] = {}
        self._pending_aborts: set[str] = set()
        self._pending_stops: set[str] = set()
        self._wakeup = asyncio.Event()
        self._subscribers: dict[int, asyncio.Queue[scheduler_pb2.StepOutputs]] = {}
        self._step_id = 0
        # Steps sent to the worker whose results are not back: (step, send time).
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self._last_num_scheduled_tokens = 0
        # A worker that misses it is treated as lost (hung, not dead).
        self.step_deadline = step_deadline or StepDeadline()
        self.healthy = True
        # Prefill/decode disaggregation: prefills run here for another replica,
        # and leases of transferred KV held until their request ran.
        self.prefills = PrefillRunner(self, self.core.connector, config.block_size, kv_leases)
        self.transfer_leases = HeldLeases(kv_leases)
        # Each traced request's spans (--otlp-traces-endpoint; None: off).
        self.traces = traces

    # ---- control (called from RPC handlers) -------------------------------

    def add_request(self, msg: scheduler_pb2.AddRequestRequest, publish: bool = True) -> Request:
        """Queue a request; ``publish=False``: its outputs go to ``prefills`` only."""
        if publish and not self._subscribers:
            raise UnavailableError("no detokenizer is subscribed to outputs")
        if not self.healthy:
            raise UnavailableError("worker unavailable")
        if self.core.get_request(msg.request_id) is not None:
            raise InvalidRequestError(f"request id {msg.request_id!r} is already in use")
        if self.core.num_waiting >= self.max_waiting_requests:
            raise OverloadedError(
                f"{self.core.num_waiting} requests already waiting; try again later"
            )
        if not msg.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids is empty")
        params = sampling_params_from_proto(msg.sampling_params)
        lora = request_lora(msg, self.core.config.max_loras)
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic(),
            priority=msg.priority,
            cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
            parallel_group=msg.parallel_group if msg.HasField("parallel_group") else None,
            resumed_output_token_ids=msg.resumed_output_token_ids,
            num_migrations=msg.num_migrations,
            lora_request=lora,
        )
        try:
            self.core.add_request(request)
        except ValueError as exc:
            # The core's one refusal: a request that could never run (longer
            # than max_model_len or than the whole KV pool), the caller's fault.
            raise InvalidRequestError(str(exc)) from exc
        header = None
        if publish:
            header = scheduler_pb2.RequestHeader(
                prompt_token_ids=msg.prompt_token_ids,
                detokenize_params=msg.detokenize_params,
                client_id=msg.client_id,
                arrival_time=time.time(),
                output_token_ids=msg.resumed_output_token_ids,
            )
            self._headers[msg.request_id] = header
            self._client_of[msg.request_id] = msg.client_id
        if self.traces is not None:
            self.traces.on_added(msg, header)
        logger.debug("request %s queued (%d prompt tokens)", msg.request_id, request.num_tokens)
        self._wakeup.set()
        return request

    async def lookup_stored_prefix(self, msg: scheduler_pb2.AddRequestRequest) -> None:
        """Tell the KV connector how much of this prompt the kvstore holds.

        Awaited by the AddRequest handler before ``add_request``, so the step
        loop never waits for the store; any failure is a miss.
        """
        if self.kv_lookup is None or self.core.connector is None:
            return
        salt = msg.cache_salt if msg.HasField("cache_salt") else None
        lora = msg.lora_request.lora_id if msg.HasField("lora_request") else None
        hashes = await self.kv_lookup.lookup(msg.prompt_token_ids, salt, lora)
        model_name = self.metrics.model_name
        self.metrics.external_queries.labels(model_name).inc(len(msg.prompt_token_ids))
        if hashes is None:
            self.metrics.connector_lookup_failures.labels(model_name).inc()
            return
        self.core.connector.record_stored(hashes)

    def abort(self, request_ids: list[str]) -> list[str]:
        live = [rid for rid in request_ids if self.core.get_request(rid) is not None]
        self._pending_aborts.update(live)
        for rid in live:
            logger.info("request %s: abort requested", rid)
        self._wakeup.set()
        return live

    def resync(self, request_ids: list[str]) -> list[str]:
        """Republish these requests from their first token; returns the ids not live here.

        A request whose header is still unsent needs nothing: its first output
        carries the header to whichever detokenizer is subscribed by then.
        """
        unknown = [rid for rid in request_ids if self.core.get_request(rid) is None]
        replays = [rid for rid in request_ids if rid in self._sent_headers]
        self._pending_replays.update(replays)
        self._wakeup.set()
        return unknown

    def requests_of_client(self, client_id: str) -> list[str]:
        """Live requests submitted by the gateway ``client_id``."""
        return [rid for rid, client in self._client_of.items() if client == client_id]

    def finish_on_stop_string(self, request_ids: list[str]) -> None:
        self._pending_stops.update(request_ids)
        self._wakeup.set()

    def subscribe(self) -> tuple[int, asyncio.Queue[scheduler_pb2.StepOutputs]]:
        queue: asyncio.Queue[scheduler_pb2.StepOutputs] = asyncio.Queue()
        key = id(queue)
        self._subscribers[key] = queue
        if self._no_subscriber_since is not None and self._sent_headers:
            # A detokenizer came back (restarted): it must know every request
            # before their next tokens reach it. Its gateways resync later.
            self._pending_replays.update(self._sent_headers)
            self.metrics.migrations.labels(self.metrics.model_name, "detokenizer").inc(
                len(self._sent_headers)
            )
            logger.info("output subscriber back: republishing %d requests", len(self._sent_headers))
        self._no_subscriber_since = None
        self._wakeup.set()  # a loop paused for a subscriber resumes
        return key, queue

    def unsubscribe(self, key: int) -> None:
        self._subscribers.pop(key, None)
        if not self._subscribers:
            # The loop pauses (see _await_subscriber): a detokenizer restarts in seconds.
            self._no_subscriber_since = time.monotonic()
            if self._client_of:
                logger.warning(
                    "no output subscriber left: %d live requests pause for up to %.0fs",
                    len(self._client_of),
                    self.subscriber_grace_s,
                )

    # ---- the step loop -----------------------------------------------------

    def _apply_pending_control(self) -> None:
        if self._pending_aborts:
            ids = [rid for rid in self._pending_aborts if self.core.get_request(rid) is not None]
            self._pending_aborts.clear()
            # Requests whose header went out hold detokenizer state: one last
            # output releases it. The others were never seen downstream.
            ended = [
                self._final_output(rid, FinishReason.ABORT)
                for rid in ids
                if rid not in self._headers
            ]
            self.core.abort_requests(ids)
            self._forget(ids, FinishReason.ABORT)
            self._publish(self._step_id, ended)
        if self._pending_stops:
            ids = [rid for rid in self._pending_stops if self.core.get_request(rid) is not None]
            self._pending_stops.clear()
            if ids:
                self.core.finish_requests(ids, RequestStatus.FINISHED_STOPPED)
            self._forget(ids, FinishReason.STOP)
        if self._pending_replays and self._subscribers:
            self._publish_replays()

    def _publish_replays(self) -> None:
        """One output per request to republish: its header and every token so far."""
        outputs = []
        for rid in self._pending_replays:
            request = self.core.get_request(rid)
            header = self._sent_headers.get(rid)
            if request is None or header is None:
                continue  # ended meanwhile; its final output went out after the resync
            replayed = scheduler_pb2.RequestHeader()
            replayed.CopyFrom(header)
            replayed.output_token_ids[:] = request.output_token_ids
            outputs.append(
                scheduler_pb2.RequestOutput(
                    request_id=rid,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    header=replayed,
                )
            )
        self._pending_replays.clear()
        if outputs:
            self._send(scheduler_pb2.StepOutputs(step_id=self._step_id, outputs=outputs))

    def _forget(self, request_ids: list[str], reason: FinishReason) -> None:
        """Drop the service's own state of requests that ended without an output."""
        for rid in request_ids:
            self._headers.pop(rid, None)
            self._sent_headers.pop(rid, None)
            self._client_of.pop(rid, None)
            if self.traces is not None:
                self.traces.on_finished(rid, reason.value)

    def _final_output(
        self, request_id: str, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        """The last output of a live request that ends outside a step (abort, lost worker)."""
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason=reason,
            stop_reason=None,
            new_logprobs=None,
            num_prompt_tokens=self.core.get_request(request_id).num_prompt_tokens,
            num_cached_tokens=0,
            error=error,
        )

    def _to_proto(self, out: RequestOutput) -> scheduler_pb2.RequestOutput:
        msg = scheduler_pb2.RequestOutput(
            request_id=out.request_id,
            new_token_ids=out.new_token_ids,
            finish_reason=finish_reason_to_proto(out.finish_reason),
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            error=out.error or "",
            pooled_data=out.pooled_data,
        )
        if out.stop_reason is not None:
            msg.stop_token_id = out.stop_reason
        if out.new_logprobs:
            msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.new_logprobs)
        if out.prompt_logprobs:
            msg.prompt_logprobs.extend(
                _UNSCORED if lp is None else logprobs_to_proto(lp) for lp in out.prompt_logprobs
            )
        # A header waits here until the request's first output carries it to
        # the detokenizer; aborts and stop-string finishes drop unsent ones.
        header = self._headers.pop(out.request_id, None)
        if header is not None:
            msg.header.CopyFrom(header)
            self._sent_headers[out.request_id] = header
        if out.finish_reason is not None:
            self._client_of.pop(out.request_id, None)
            self._sent_headers.pop(out.request_id, None)
        return msg

    def _publish(self, step_id: int, outputs: list[RequestOutput]) -> None:
        if self.traces is not None and self.traces:
            for out in outputs:
                if out.finish_reason is not None:
                    self.traces.on_finished(
                        out.request_id, out.finish_reason.value, out.num_cached_tokens
                    )
        outputs = self.prefills.take_outputs(outputs)
        if not outputs:
            return
        self._send(
            scheduler_pb2.StepOutputs(step_id=step_id, outputs=[self._to_proto(o) for o in outputs])
        )

    def _send(self, batch: scheduler_pb2.StepOutputs) -> None:
        for key, queue in list(self._subscribers.items()):
            if queue.qsize() >= _MAX_SUBSCRIBER_BACKLOG:
                logger.error("subscriber %s is %d steps behind; dropping it", key, queue.qsize())
                self._subscribers.pop(key, None)
                continue
            queue.put_nowait(batch)

    def _migrate_all(self, reason: str) -> None:
        """The worker is lost: its running requests wait, with their tokens so far,
        for the restarted worker (request migration). One lost with more than
        ``max_migrations`` workers fails instead (it may be what kills them), and
        so do prefills for another replica, which computes the prompt itself."""
        moved = self.core.requeue_after_worker_loss()
        self.metrics.migrations.labels(self.metrics.model_name, "worker").inc(len(moved))
        too_many = (
            f"{reason}; the request was migrated {self.max_migrations + 1} times "
            f"(--max-migrations {self.max_migrations}), giving up"
        )
        errors = {r.request_id: too_many for r in moved if r.num_migrations > self.max_migrations}
        errors.update(
            (rid, reason) for rid in self.core.live_request_ids() if rid not in self._client_of
        )
        failed = [self._final_output(rid, FinishReason.ERROR, e) for rid, e in errors.items()]
        self.core.finish_requests([out.request_id for out in failed], RequestStatus.FINISHED_ERROR)
        # Also settles prefills waiting for saves the lost worker will never confirm.
        self._publish(self._step_id, failed)
        logger.error(
            "%s: %d running requests wait for the worker, %d failed",
            reason,
            len(moved),
            len(failed),
        )

    async def _reconnect(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                info = await self.worker.connect(timeout=30)
            except Exception as e:
                logger.warning("worker not back yet: %s", e)
                await asyncio.sleep(1)
                continue
            if info.runner != "pooling" and info.num_kv_blocks != self.config.num_kv_blocks:
                logger.error(
                    "worker came back with %d KV blocks (had %d); restart the scheduler",
                    info.num_kv_blocks,
                    self.config.num_kv_blocks,
                )
            windows = windows_from_wire(info.kv_cache_group_windows)
            if info.runner != "pooling" and windows != self.config.kv_cache_windows:
                logger.error(
                    "worker came back with KV-cache group windows %s (had %s); restart the "
                    "scheduler",
                    windows,
                    self.config.kv_cache_windows,
                )
            self.healthy = True
            self.step_deadline.reset()  # a restarted worker starts cold
            logger.info("worker reconnected")
            return

    async def _async_step(self) -> None:
        """Send the next step if fewer than ``steps_in_flight`` are (two; with
        micro-batches one per pipeline stage), then collect the oldest."""
        self._apply_pending_control()
        scheduled = False
        depth = self.config.steps_in_flight
        if len(self._in_flight) < depth and self._has_work():
            scheduler_output = self.core.schedule()
            self._step_id += 1
            scheduler_output.step_id = self._step_id
            if self.traces is not None:
                self.traces.on_scheduled(scheduler_output)
            self._last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
            if self._worth_sending(scheduler_output):
                self._in_flight.append((scheduler_output, time.perf_counter()))
                await self.worker.submit(scheduler_output)
                scheduled = True
        if not self._in_flight or (len(self._in_flight) < depth and scheduled):
            return  # a burst is starting: fill the pipeline before waiting
        scheduler_output, start = self._in_flight[0]
        runner_output = await self._within_deadline(
            scheduler_output, self.worker.receive(scheduler_output.step_id)
        )
        self._in_flight.popleft()
        # Aborts and stop-string finishes that arrived meanwhile go first, so a
        # request finished by a stop string publishes no tokens past it.
        self._apply_pending_control()
        outputs = self.core.update_from_output(scheduler_output, runner_output)
        self._publish(scheduler_output.step_id, outputs)
        self.metrics.step_seconds.labels(self.metrics.model_name).observe(
            time.perf_counter() - start
        )

    async def _within_deadline(
        self, scheduler_output: SchedulerOutput, result: Awaitable[ModelRunnerOutput]
    ) -> ModelRunnerOutput:
        """The worker's answer to a step, or UnavailableError once it is overdue."""
        num_tokens = scheduler_output.total_num_scheduled_tokens
        deadline = self.step_deadline.for_step(num_tokens)
        started = time.perf_counter()
        try:
            runner_output = await asyncio.wait_for(result, deadline)
        except TimeoutError:
            logger.error(
                "worker did not answer step %d (%d tokens) in %.1fs; treating it as lost",
                scheduler_output.step_id,
                num_tokens,
                deadline,
            )
            raise UnavailableError(
                f"worker did not answer in {deadline:.1f}s (hung); treated as lost"
            ) from None
        self.step_deadline.record(time.perf_counter() - started, num_tokens)
        return runner_output

    def _has_work(self) -> bool:
        return self.core.has_unfinished_requests() or self.core.has_connector_work()

    def _worth_sending(self, scheduler_output: SchedulerOutput) -> bool:
        """Tokens to compute, requests to drop, connector work, or a load to collect."""
        return bool(
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.finished_req_ids
            or not scheduler_output.kv_connector_metadata.is_empty()
            or self.core.has_connector_work()
        )

    async def _step(self) -> None:
        if self.config.async_scheduling:
            await self._async_step()
            return
        self._apply_pending_control()
        scheduler_output: SchedulerOutput = self.core.schedule()
        self._step_id += 1
        scheduler_output.step_id = self._step_id
        if self.traces is not None:
            self.traces.on_scheduled(scheduler_output)
        self._last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if not self._worth_sending(scheduler_output):
            return
        start = time.perf_counter()
        runner_output = await self._within_deadline(
            scheduler_output, self.worker.execute(scheduler_output)
        )
        outputs = self.core.update_from_output(scheduler_output, runner_output)
        self._publish(self._step_id, outputs)
        self.metrics.step_seconds.labels(self.metrics.model_name).observe(
            time.perf_counter() - start
        )

    def _only_polling(self) -> bool:
        """Whether the last step computed nothing and loads are still to collect."""
        return (
            self._last_num_scheduled_tokens == 0
            and not self._pending_aborts
            and self.core.has_connector_work()
        )

    async def _await_subscriber(self, stop_task: asyncio.Future[object]) -> None:
        """Hold every step while no detokenizer listens (its outputs would be lost)
        until one subscribes; past the grace period abort the published requests."""
        since = self._no_subscriber_since
        if since is None:
            since = self._no_subscriber_since = time.monotonic()
        left = self.subscriber_grace_s - (time.monotonic() - since)
        if left <= 0:
            live = self.abort(list(self._client_of))
            logger.warning(
                "no output subscriber for %.0fs: aborting %d live requests",
                self.subscriber_grace_s,
                len(live),
            )
            self._apply_pending_control()
            return
        self._wakeup.clear()
        wake = asyncio.ensure_future(self._wakeup.wait())
        await asyncio.wait({wake, stop_task}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        wake.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        stop_task = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                # Each turn of the loop, the worker down included.
                self.transfer_leases.release_settled(self.core)
                if self.healthy and not self.worker.connected:
                    # The step stream ended between steps (the worker died idle).
                    self.healthy = False
                    self._migrate_all("worker unavailable: its step stream ended")
                if not self.healthy:
                    # Shutdown must not wait for a worker that may never return.
                    reconnect = asyncio.ensure_future(self._reconnect(stop))
                    await asyncio.wait({reconnect, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                    if not reconnect.done():
                        reconnect.cancel()
                    continue
                if not self._subscribers and self._client_of:
                    await self._await_subscriber(stop_task)
                    continue
                if not self._has_work() and not self._pending_aborts and not self._in_flight:
                    self.metrics.record(self.core.make_stats())
                    self._wakeup.clear()
                    wake = asyncio.ensure_future(self._wakeup.wait())
                    lost = asyncio.ensure_future(self.worker.stream_ended.wait())
                    await asyncio.wait({wake, lost, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    lost.cancel()
                    continue
                try:
                    await self._step()
                except UnavailableError as e:
                    self.healthy = False
                    self._in_flight.clear()
                    self._migrate_all(f"worker unavailable: {e}")
                    self.metrics.record(self.core.make_stats())  # not stale while it is down
                    continue
                self.metrics.record(self.core.make_stats())
                if self._only_polling():
                    # Nothing to compute while loads run in the worker's background:
                    # poll gently instead of spinning a core the worker needs.
                    await asyncio.sleep(_LOAD_POLL_INTERVAL_S)
                # Let RPC handlers (new requests, aborts) in between steps.
                await asyncio.sleep(0)
        finally:
            stop_task.cancel()


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: SchedulerEngine, info: scheduler_pb2.SchedulerInfo) -> None:
        self.engine = engine
        self.info = info

    async def AddRequest(self, request, context):
        with self.engine.transfer_leases.held_for(request):
            await self.engine.lookup_stored_prefix(request)
            if request.sampling_params.HasField("structured_output"):
                # Awaited here, not in the step loop: this request waits for its
                # grammar while the loop keeps stepping the others.
                await self.engine.worker.prepare_structured_output(
                    request.request_id, request.sampling_params.structured_output
                )
            self.engine.add_request(request)
        return scheduler_pb2.AddRequestResponse()

    async def Prefill(self, request, context):
        return await self.engine.prefills.prefill(request)

    async def AbortRequests(self, request, context):
        ids = list(request.request_ids)
        if request.client_id:
            ids += self.engine.requests_of_client(request.client_id)
        return scheduler_pb2.AbortRequestsResponse(aborted_ids=self.engine.abort(ids))

    async def ResyncRequests(self, request, context):
        unknown = self.engine.resync(list(request.request_ids))
        return scheduler_pb2.ResyncRequestsResponse(unknown_ids=unknown)

    async def FinishRequests(self, request, context):
        self.engine.finish_on_stop_string(list(request.request_ids))
        return scheduler_pb2.FinishRequestsResponse()

    async def StreamOutputs(self, request, context) -> AsyncIterator[scheduler_pb2.StepOutputs]:
        key, queue = self.engine.subscribe()
        # Headers now, so the subscriber's wait_for_connection() returns before
        # the first step output exists.
        await context.send_initial_metadata(())
        logger.info("output subscriber %r attached", request.subscriber)
        try:
            while True:
                yield await queue.get()
        finally:
            self.engine.unsubscribe(key)
            logger.info("output subscriber %r detached", request.subscriber)

    async def CheckReady(self, request, context):
        if not self.engine.healthy:
            raise UnavailableError("worker unavailable")
        if not self.engine._subscribers:
            raise UnavailableError("no detokenizer subscribed")
        info = await self.engine.worker.get_info()
        return scheduler_pb2.CheckReadyResponse(
            detail=f"ready: worker on {info.device}, {info.num_kv_blocks} KV blocks, "
            f"attention {info.attention_backend}"
        )

    async def GetInfo(self, request, context):
        return self.info
