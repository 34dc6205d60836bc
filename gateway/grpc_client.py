"""The gateway's EngineClient over gRPC: submit to the scheduler, read the detokenizer.

One StreamDetokenized subscription (keyed by this gateway's client_id)
carries the deltas of every request this gateway submitted; a dispatcher task
routes them to per-request queues. A broken stream fails the in-flight
requests with an error delta (HTTP clients see it as a 503 / error finish),
aborts them in the scheduler, and reconnects.

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
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine

import grpc

from gateway.disaggregation import PrefillClient
from gateway.engine_client import (
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    TopLogprob,
)
from protos import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.errors import InvalidRequestError, UnavailableError, error_from_rpc
from services.grpc_server import insecure_channel
from services.step_codec import (
    detokenize_params_to_proto,
    lora_request_to_proto,
    sampling_params_to_proto,
)

logger = logging.getLogger(__name__)

_MAX_ADMISSIONS_IN_FLIGHT = 32
_MAX_UNREAD_DELTAS = 1024

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class GrpcEngineClient:
    def __init__(
        self,
        scheduler_addr: str,
        detokenizer_addr: str,
        token_text: Callable[[int], str],
        client_id: str | None = None,
        prefill: PrefillClient | None = None,
    ) -> None:
        self.scheduler_addr = scheduler_addr
        self.detokenizer_addr = detokenizer_addr
        self.client_id = client_id or f"gateway-{uuid.uuid4().hex[:12]}"
        self._token_text = token_text
        self._scheduler_channel = insecure_channel(scheduler_addr)
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        # Disaggregation: prompts are prefilled there first (gateway/disaggregation.py).
        self._prefill = prefill
        self._queues: dict[str, asyncio.Queue[GenerationDelta]] = {}
        self._subscribed = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._model_info: ModelInfo | None = None
        self._closing = False
        # Fire-and-forget aborts, referenced until done.
        self._background: set[asyncio.Future[None]] = set()
        self._admissions = asyncio.Semaphore(_MAX_ADMISSIONS_IN_FLIGHT)

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

    def _to_delta(self, out: detokenizer_pb2.DetokenizedOutput) -> GenerationDelta:
        stop_reason: int | str | None = None
        which = out.WhichOneof("stop_reason")
        if which == "stop_token_id":
            stop_reason = out.stop_token_id
        elif which == "stop_string":
            stop_reason = out.stop_string
        logprobs = None
        if len(out.logprobs):
            logprobs = [self._token_logprob(lp) for lp in out.logprobs]
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if len(out.prompt_logprobs):
            # Entry 0 is the first prompt token, which has no logprob.
            prompt_logprobs = [None]
            prompt_logprobs += [
                None if lp.token_id < 0 else self._token_logprob(lp) for lp in out.prompt_logprobs
            ]
        return GenerationDelta(
            request_id=out.request_id,
            text=out.text,
            token_ids=list(out.token_ids),
            finish_reason=_FINISH_REASONS[out.finish_reason],
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            logprobs=logprobs,
            error=out.error or None,
            prompt_logprobs=prompt_logprobs,
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

    def _fail(self, rid: str, reason: str) -> None:
        """End ``rid`` for its reader with an error (ahead of anything unread)."""
        queue = self._queues.pop(rid, None)
        if queue is None:
            return
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(
            GenerationDelta(
                request_id=rid,
                text="",
                token_ids=[],
                finish_reason="error",
                stop_reason=None,
                num_prompt_tokens=0,
                num_cached_tokens=0,
                num_output_tokens=0,
                logprobs=None,
                error=reason,
            )
        )

    def _fail_all(self, reason: str) -> None:
        ids = list(self._queues)
        for rid in ids:
            self._fail(rid, reason)
        if ids:
            # Their outputs could no longer reach this gateway: stop computing them.
            self._in_background(self._abort_many(ids))

    def _deliver(self, out: detokenizer_pb2.DetokenizedOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is None:
            return  # finished, aborted or failed here already
        try:
            queue.put_nowait(self._to_delta(out))
        except asyncio.QueueFull:
            logger.warning(
                "request %s: reader %d deltas behind; failing it", out.request_id, queue.qsize()
            )
            self._fail(out.request_id, f"the client fell {_MAX_UNREAD_DELTAS} steps behind")
            self._in_background(self._abort_many([out.request_id]))

    async def _dispatch_forever(self) -> None:
        while not self._closing:
            try:
                async with insecure_channel(self.detokenizer_addr) as channel:
                    stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
                    stream = stub.StreamDetokenized(
                        detokenizer_pb2.StreamDetokenizedRequest(client_id=self.client_id)
                    )
                    await stream.wait_for_connection()
                    self._subscribed.set()
                    logger.info(
                        "subscribed to detokenizer %s as %s", self.detokenizer_addr, self.client_id
                    )
                    async for batch in stream:
                        for out in batch.outputs:
                            self._deliver(out)
            except grpc.aio.AioRpcError as e:
                log = logger.warning if self._subscribed.is_set() else logger.debug
                log("detokenizer stream broke: %s %s", e.code().name, e.details())
            self._subscribed.clear()
            self._fail_all("detokenizer unavailable")
            if not self._closing:
                await asyncio.sleep(0.5)

    # ---- EngineClient ------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if not self._subscribed.is_set():
            raise UnavailableError("engine unavailable: not subscribed to the detokenizer")
        rid = request.request_id
        if rid in self._queues:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        # One slot more than the bound: room for the error that ends an overflow.
        queue: asyncio.Queue[GenerationDelta] = asyncio.Queue(maxsize=_MAX_UNREAD_DELTAS + 1)
        self._queues[rid] = queue
        finished = False
        try:
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
            # The prefill replica runs the base model only: adapter prompts are
            # computed where they decode.
            if self._prefill is not None and request.lora_request is None:
                transfer = await self._prefill.prefill(msg)
                if transfer is not None:
                    msg.kv_transfer.CopyFrom(transfer)
            try:
                await self._admit(msg)
            except grpc.aio.AioRpcError as e:
                finished = True  # never admitted: nothing to abort
                raise error_from_rpc(e) from e
            while True:
                delta = await queue.get()
                if delta.finished:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                # The consumer went away (client disconnect, cancellation).
                self._in_background(self.abort(rid))

    async def _admit(self, msg: scheduler_pb2.AddRequestRequest) -> None:
        if msg.sampling_params.HasField("structured_output"):
            await self._scheduler.AddRequest(msg, timeout=30)
            return
        async with self._admissions:
            await self._scheduler.AddRequest(msg, timeout=30)

    def _in_background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        await self._abort_many([request_id])

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
