"""The scheduler: one ``schedule()`` and one ``update_from_output()`` per engine step.

Each step spends a token budget: running requests first, in admission order,
then waiting ones with what is left. A request advances by the tokens it still
has to compute (``num_tokens - num_computed_tokens``), clipped by the budget and
``long_prefill_token_threshold``; so a long prompt is prefilled in chunks while
decodes keep going, and there is no prefill/decode mode. When a running request
cannot get a block, the policy's victim is preempted (recompute: its blocks are
freed and it goes back to the front of the waiting queue).

Not thread-safe: the service loop owns one Scheduler and calls it from one task.
Synchronous mode: ``schedule()`` and ``update_from_output()`` alternate and
``num_computed_tokens`` advances when the worker's output comes back.

Asynchronous mode (``config.async_scheduling``): step n+1 is scheduled while
step n is still in the worker, so ``num_computed_tokens`` advances at schedule
time. A running request whose last scheduled step samples gets one output
placeholder (``num_output_placeholders``); its next decode is scheduled against
that placeholder, since the worker appends the token it samples itself and the
step contract carries no token ids for requests the worker holds. Outputs for a
request that finished (or was preempted or aborted) after being scheduled
again are discarded, and a request whose placeholders already reach its length
limit is not scheduled again. Outputs are identical to synchronous mode.

Micro-batches (``config.num_micro_batches`` = P > 1, pipeline parallelism):
async scheduling with up to P steps in flight, each a micro-batch of requests
disjoint from the other in-flight steps, so that each pipeline stage has a
step of its own to run. A running request that is in an unanswered step is
skipped until that step's output is back (so it never has more than one
placeholder), and each step takes at most ``ceil(running / P)`` running
requests, so the running batch splits into P micro-batches of equal size
rather than one full step followed by empty ones. Each micro-batch gets the
whole token budget: the budget bounds one forward pass (its activations and
its latency per stage), and each micro-batch is a forward pass of its own;
splitting it would only halve prefill chunks (vLLM does the same). A request
preempted or aborted while in flight is not admitted again until its step is
answered, so a stale answer never meets a re-admitted request, and the worker
drops its row only once that step is done with it.

With the KV connector (``config.enable_kv_connector``, scheduler/kv_connector.py)
a waiting request whose next blocks the kvstore holds does not compute them:
its blocks are reserved, the worker loads them in the background while the
request waits in WAITING_FOR_REMOTE_KVS, and once the load is reported the
loaded blocks join the local prefix cache and the request goes back to the
front of the waiting queue, where admission finds them as ordinary hits.
Blocks that become full and computed are saved to the store through the
``KVCacheManager`` hook. A load that comes back short only means fewer hits.

With speculative decoding (``config.speculative``, synchronous mode only) a
running request about to decode one token may also carry draft tokens from
the ``Speculator`` (scheduler/spec_decode/): they count in its scheduled tokens
and get KV slots (above the watermark only). The worker answers the accepted
drafts plus one token; ``num_computed_tokens`` then counts only the accepted
ones, blocks are cached only up to them, and the tail only rejected drafts
needed is freed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvmesh.scheduler.block_pool import KVCacheBlock, KVCacheIntegrityError
from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.kv_cache_manager import GroupBlocks, KVCacheManager
from kvmesh.scheduler.kv_connector import KVConnectorScheduler
from kvmesh.scheduler.lora_admission import AdapterAdmission
from kvmesh.scheduler.output import FinishedRequestStats, RequestOutput, SchedulerStats
from kvmesh.scheduler.policy import make_policy
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.spec_decode.speculator import Speculator
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.step import (
    CachedRequestData,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler:
    """Owns every live request, the waiting queue, the running batch and the KV blocks.

    Invariants (asserted by ``check_integrity``): each live request is in
    ``requests`` and in exactly one of ``waiting`` (WAITING or PREEMPTED,
    holding no blocks) and ``running`` (RUNNING, holding blocks for its
    computed tokens); the worker holds exactly ``running`` plus the requests
    the next step tells it to drop. Block arithmetic belongs to the
    ``KVCacheManager``; this class counts tokens.

    Not thread-safe: one task calls every method (the service applies control
    calls that arrive mid-step between steps).
    """

    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.policy = make_policy(config.policy)
        self.connector = (
            KVConnectorScheduler(config.block_size) if config.enable_kv_connector else None
        )
        self.kv_cache_manager = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            prefix_hash=config.prefix_hash,
            on_blocks_cached=self.connector.on_blocks_cached if self.connector else None,
            group_windows=config.kv_cache_windows,
        )
        # Several KV-cache groups: each step carries groups 1..'s new block ids too.
        self._multi_group = len(config.kv_cache_windows) > 1
        # Every live (unfinished) request, by id.
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.make_waiting_queue()
        # In admission order; the worker holds exactly these requests.
        self.running: list[Request] = []
        # KV connector: requests whose blocks the worker is loading, by id.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Requests the worker must drop at the next step.
        self._finished_req_ids: set[str] = set()
        # Micro-batches: requests in steps sent but not yet answered.
        self._in_flight_ids: set[str] = set()
        self._step_id = 0
        self._num_watermark_blocks = config.num_watermark_blocks
        # Counters since the last make_stats().
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._num_preemptions = 0
        self._finished_stats: list[FinishedRequestStats] = []
        # parallel_group -> the sibling admitted first (until it finishes).
        self._group_leaders: dict[str, Request] = {}
        self.speculator = (
            Speculator(config.speculative, config.max_model_len)
            if config.speculative is not None
            else None
        )

    # ---- requests in and out ------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never run."""
        config = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if config.pooling != (request.sampling_params.pooling is not None):
            raise ValueError(
                "this server runs a pooling model (embeddings, score, rerank, classify) and "
                "generates no text"
                if config.pooling
                else "this server runs a generation model; pooling requests need a pooling model"
            )
        # The one length check: SchedulerConfig makes the KV pool hold at least
        # max_model_len tokens, so a prompt within it always fits the pool alone.
        # (A continuation counts the output it resumes with.)
        if request.num_tokens > config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_tokens} "
                f"tokens, more than max_model_len={config.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)
        logger.debug(
            "request %s queued (%s prompt tokens)", request.request_id, request.num_prompt_tokens
        )

    def abort_requests(self, request_ids: Iterable[str] | str) -> list[str]:
        """Abort requests in any live state; their blocks are freed at once.

        Returns the ids actually removed (unknown or already finished ids are skipped).
        """
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> list[str]:
        """Finish live requests with ``status`` (e.g. FINISHED_STOPPED on a stop string)."""
        if not status.is_finished():
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed: list[str] = []
        any_running = any_waiting = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is _WAITING_FOR_REMOTE_KVS:
                self._finish_loading(request, status)
                removed.append(request_id)
                continue
            held_by_worker = request.status == _RUNNING
            if held_by_worker:
                any_running = True
            else:
                any_waiting = True
            self._finish(request, status, held_by_worker)
            removed.append(request_id)
        if any_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if any_waiting:
            self.waiting.remove_requests([r for r in self.waiting if r.status.is_finished()])
        if removed:
            logger.info("finished %s with %s", removed, status.name)
        return removed

    def _finish(self, request: Request, status: RequestStatus, held_by_worker: bool) -> None:
        """Free a request's blocks and retire it; the caller drops it from its queue."""
        if held_by_worker:
            self._finished_req_ids.add(request.request_id)
        group = request.parallel_group
        if group is not None and self._group_leaders.get(group) is request:
            del self._group_leaders[group]
        request.status = status
        self.kv_cache_manager.free(request)
        if self.speculator is not None:
            self.speculator.finish(request)
        del self.requests[request.request_id]
        now = request.finished_time = self.clock()
        scheduled, first_token = request.first_scheduled_time, request.first_token_time
        self._finished_stats.append(
            FinishedRequestStats(
                request_id=request.request_id,
                finish_reason=status.finish_reason,  # type: ignore[arg-type]
                num_prompt_tokens=request.num_prompt_tokens,
                num_generation_tokens=request.num_output_tokens,
                queue_time=None if scheduled is None else scheduled - request.arrival_time,
                prefill_time=(
                    None if scheduled is None or first_token is None else first_token - scheduled
                ),
                decode_time=None if first_token is None else now - first_token,
            )
        )

    def _finish_loading(self, request: Request, status: RequestStatus) -> None:
        """Finish a request whose KV load is planned or in flight.

        Like a running request it goes into the next step's ``finished_req_ids``:
        the worker drops its load before that step writes anything, so its
        blocks are free for anyone at once.
        """
        del self.waiting_for_remote_kvs[request.request_id]
        assert self.connector is not None
        self.connector.cancel_load(request.request_id)
        self._finish(request, status, held_by_worker=True)

    def _requeue(self, request: Request) -> None:
        """Drop a running request's KV and put it back at the front of the line.

        Its tokens so far stay: its next admission sends them to the worker
        (NewRequestData.output_token_ids), which recomputes their KV.
        """
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token still in flight is dropped: the resumed request recomputes it.
        request.num_output_placeholders = 0
        self.waiting.prepend(request)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, requeue at the front of the line."""
        self._requeue(request)
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._finished_req_ids.add(request.request_id)
        logger.info(
            "request %s preempted (%s tokens, preemption #%s)",
            request.request_id,
            request.num_tokens,
            request.num_preemptions,
        )

    # ---- schedule: running requests, then waiting ones -----------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next engine step: which requests advance by how many tokens.

        Promises:
        - at most ``max_num_batched_tokens`` tokens and ``max_num_seqs``
          requests; every scheduled request holds blocks for its computed
          tokens plus the scheduled ones (allocated here);
        - running requests are served first, in admission order; waiting ones
          are admitted in policy order with what is left, head-of-line (a
          request that does not fit holds back the ones behind it), and not at
          all in a step that had to preempt;
        - the requests the worker holds that finished, were aborted or were
          preempted since the previous step are in ``finished_req_ids``: the
          worker drops them before running this step, whose blocks may be theirs.

        The caller sends every output to the worker, in order, and hands the
        worker's answer to ``update_from_output``: in synchronous mode before
        the next ``schedule()``, in async mode at most one step later.
        """
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        drafts: dict[str, list[int]] = {}
        token_budget, preempted = self._schedule_running(num_scheduled_tokens, cached, drafts)
        # Waiting requests only if blocks were not just too short to keep everyone.
        new_reqs = [] if preempted else self._schedule_waiting(token_budget, num_scheduled_tokens)
        output = self._make_scheduler_output(new_reqs, cached, num_scheduled_tokens)
        if self.config.num_micro_batches > 1:
            self._in_flight_ids.update(num_scheduled_tokens)
        if drafts:
            # A request preempted later in the pass left the step with its drafts.
            output.scheduled_spec_decode_tokens = {
                req_id: d for req_id, d in drafts.items() if req_id in num_scheduled_tokens
            }
        return output

    def _schedule_running(
        self,
        num_scheduled_tokens: dict[str, int],
        cached: CachedRequestData,
        drafts: dict[str, list[int]],
    ) -> tuple[int, bool]:
        """Advance running requests in admission order, preempting when blocks run out.

        Fills ``num_scheduled_tokens``, ``cached`` and ``drafts`` (speculative
        decoding); returns the token budget left and whether any request was
        preempted.
        """
        config = self.config
        allocate_slots = self.kv_cache_manager.allocate_slots
        token_budget = config.max_num_batched_tokens
        threshold = config.long_prefill_token_threshold
        async_scheduling = config.async_scheduling
        max_model_len = config.max_model_len
        running = self.running
        cached_req_ids = cached.req_ids
        cached_new_block_ids = cached.new_block_ids
        cached_num_computed = cached.num_computed_tokens
        multi_group = self._multi_group
        kv = self.kv_cache_manager
        preempted = False
        speculator = self.speculator
        if speculator is not None and speculator.batch_too_large(len(running)):
            speculator = None
        # Micro-batches: requests of unanswered steps sit this one out, and each
        # step takes its share of the running batch.
        in_flight = self._in_flight_ids if config.num_micro_batches > 1 else None
        max_running = cdiv(len(running), config.num_micro_batches)
        num_running_scheduled = 0

        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            if in_flight is not None:
                if request.request_id in in_flight:
                    index += 1
                    continue
                if num_running_scheduled >= max_running:
                    break
            if request.sampling_params.pooling is not None:
                # Its one step is in flight (async mode): it never runs again.
                index += 1
                continue
            num_computed_tokens = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_new_tokens = len(request.all_token_ids) + num_placeholders - num_computed_tokens
            if num_placeholders and self._length_reached_in_flight(request, max_model_len):
                num_new_tokens = 0  # its in-flight token is its last one
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens <= 0:
                index += 1
                continue
            new_blocks = None
            if num_new_tokens == 1 and speculator is not None:
                # Drafts only where blocks are plentiful (the watermark): they
                # must never be the reason someone gets preempted.
                request_drafts = speculator.propose(request, token_budget, self._step_id)
                if request_drafts:
                    new_blocks = allocate_slots(
                        request, 1 + len(request_drafts), (), self._num_watermark_blocks
                    )
                    if new_blocks is not None:
                        num_new_tokens += len(request_drafts)
                        drafts[request.request_id] = request_drafts
            if new_blocks is None:
                new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                preempted = True
                new_blocks, index = self._preempt_for(
                    request, num_new_tokens, index, num_scheduled_tokens, cached
                )
                # Victims scheduled earlier in this pass gave their tokens back.
                token_budget = config.max_num_batched_tokens - sum(num_scheduled_tokens.values())
                if new_blocks is None:
                    break  # the request itself was the victim: no room this step
            request_id = request.request_id
            num_scheduled_tokens[request_id] = num_new_tokens
            token_budget -= num_new_tokens
            cached_req_ids.append(request_id)
            cached_new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            if multi_group:
                cached.new_group_block_ids.append(
                    kv.get_new_group_block_ids(request_id, len(new_blocks))
                )
            cached_num_computed.append(num_computed_tokens)
            if async_scheduling:
                self._advance_at_schedule(request, num_new_tokens)
            num_running_scheduled += 1
            index += 1
        return token_budget, preempted

    def _preempt_for(
        self,
        request: Request,
        num_new_tokens: int,
        index: int,
        num_scheduled_tokens: dict[str, int],
        cached: CachedRequestData,
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt the policy's victims until ``running[index]`` gets blocks for its tokens.

        A victim already scheduled in this pass is taken back out of the step.
        Returns the request's new blocks (None if it became the victim itself)
        and its index in ``running`` now.
        """
        running = self.running
        while True:
            victim_index = self.policy.select_victim(running)
            victim = running.pop(victim_index)
            if victim_index < index:
                index -= 1
                self._unschedule(victim, num_scheduled_tokens, cached)
            self._preempt(victim)
            if victim is request:
                return None, index
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, index

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int]
    ) -> list[NewRequestData]:
        """Admit waiting requests in policy order while budget, seats and blocks last."""
        config = self.config
        kv = self.kv_cache_manager
        threshold = config.long_prefill_token_threshold
        running = self.running
        waiting = self.waiting
        new_reqs: list[NewRequestData] = []
        if not waiting:
            return new_reqs
        now = self.clock()  # one timestamp for every request scheduled here for the first time
        adapters = AdapterAdmission(config.max_loras, running)
        while waiting and token_budget > 0 and len(running) < config.max_num_seqs:
            request = waiting.peek()
            if request.request_id in self._in_flight_ids:
                # Preempted while in an unanswered step: head-of-line until it is back.
                break
            if request.parallel_group is not None and self._defer_sibling(request):
                break  # head-of-line, as when blocks are short: its turn comes in a step or two
            if not adapters.admits(request):
                adapters.skip(waiting.pop())  # its adapter waits for a free slot; others go on
                continue
            if request.sampling_params.pooling is not None:
                # An encoder needs its whole input in one step and keeps no KV:
                # no cache lookup, no blocks, never chunked (add_request bounds
                # its length by the budget). Head-of-line when it does not fit.
                if request.num_tokens > token_budget:
                    break
                waiting.pop()
                new_reqs.append(self._admit(request, 0, request.num_tokens, now))
                num_scheduled_tokens[request.request_id] = request.num_tokens
                token_budget -= request.num_tokens
                continue
            # Prompt logprobs come from the logits of every prompt position, which
            # a cache hit (local, or loaded by the connector) never computes: such
            # a request computes its whole prompt (vLLM's rule).
            computes_whole_prompt = request.sampling_params.prompt_logprobs is not None
            computed_blocks, num_cached_tokens = (
                ((), 0) if computes_whole_prompt else kv.get_computed_blocks(request)
            )
            # With nothing running there is nobody to keep room for, and a request
            # needing the whole pool must still be admitted.
            watermark = self._num_watermark_blocks if running else 0
            if self.connector is not None and not computes_whole_prompt:
                num_external_tokens, _ = self.connector.get_num_new_matched_tokens(
                    request, num_cached_tokens
                )
                if num_external_tokens:
                    if not self._start_remote_load(
                        request, computed_blocks, num_cached_tokens, num_external_tokens, watermark
                    ):
                        break  # head-of-line, as below
                    continue
            num_new_tokens = request.num_tokens - num_cached_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if kv.allocate_slots(request, num_new_tokens, computed_blocks, watermark) is None:
                break  # head-of-line: later requests wait too, keeping the order fair
            waiting.pop()
            new_reqs.append(self._admit(request, num_cached_tokens, num_new_tokens, now))
            adapters.add(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        adapters.requeue_skipped(waiting)
        return new_reqs

    def _start_remote_load(
        self,
        request: Request,
        computed_blocks: GroupBlocks,
        num_cached_tokens: int,
        num_external_tokens: int,
        watermark: int,
    ) -> bool:
        """Reserve blocks for the tokens the store holds and plan their load.

        The request leaves the waiting queue for WAITING_FOR_REMOTE_KVS: no
        step computes into its blocks and the worker does not hold it. False
        (nothing changed) when the blocks are not there.
        """
        assert self.connector is not None
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_external_tokens, computed_blocks, watermark
        )
        if new_blocks is None:
            return False
        self.waiting.pop()
        request.status = _WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, [b.block_id for b in new_blocks], num_cached_tokens, num_external_tokens
        )
        logger.debug(
            "request %s: loading %s tokens from the kvstore after %s local hits",
            request.request_id,
            num_external_tokens,
            num_cached_tokens,
        )
        return True

    def _admit(
        self, request: Request, num_cached_tokens: int, num_new_tokens: int, now: float
    ) -> NewRequestData:
        """Move a request that got its blocks from waiting to running; describe it in full."""
        self.running.append(request)
        request.status = _RUNNING
        request.num_computed_tokens = num_cached_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.num_cached_tokens = num_cached_tokens
        self._prefix_cache_queries += request.num_tokens
        self._prefix_cache_hits += num_cached_tokens
        new_req = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            group_block_ids=self.kv_cache_manager.get_group_block_ids(request.request_id),
            num_computed_tokens=num_cached_tokens,
            lora_request=request.lora_request,
        )
        if self.config.async_scheduling and request.sampling_params.pooling is None:
            self._advance_at_schedule(request, num_new_tokens)
        return new_req

    def _make_scheduler_output(
        self,
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
        num_scheduled_tokens: dict[str, int],
    ) -> SchedulerOutput:
        """Seal the step: number it and hand over the ids the worker must drop."""
        finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta()
        self._step_id += 1
        return output

    @staticmethod
    def _advance_at_schedule(request: Request, num_new_tokens: int) -> None:
        """Async mode: scheduled tokens count as computed now; sampling adds a placeholder."""
        num_computed = request.num_computed_tokens = request.num_computed_tokens + num_new_tokens
        if num_computed == len(request.all_token_ids) + request.num_output_placeholders:
            request.num_output_placeholders += 1

    @staticmethod
    def _length_reached_in_flight(request: Request, max_model_len: int) -> bool:
        """Whether the tokens in flight already take the request to max_tokens or max_model_len.

        Scheduling it again would only compute a token that is thrown away.
        """
        num_placeholders = request.num_output_placeholders
        return (
            len(request.output_token_ids) + num_placeholders >= request.sampling_params.max_tokens
            or len(request.all_token_ids) + num_placeholders >= max_model_len
        )

    def _defer_sibling(self, request: Request) -> bool:
        """Hold an n > 1 sibling until the first one's prompt KV is computed and cached.

        Blocks enter the prefix cache only once computed, so siblings admitted
        together would each compute the whole prompt; admitted after the first
        one's prompt, they hit the cache for every full prompt block.
        """
        group = request.parallel_group
        assert group is not None
        leader = self._group_leaders.get(group)
        if leader is None or leader is request:
            self._group_leaders[group] = request
            return False
        # "Has its first token" rather than "num_computed_tokens covers the prompt":
        # with async scheduling num_computed_tokens runs ahead at schedule time,
        # while blocks are cached (and the first token appended) only when the
        # step's output comes back.
        return leader.status == _RUNNING and leader.num_output_tokens == 0

    @staticmethod
    def _unschedule(
        victim: Request, num_scheduled_tokens: dict[str, int], cached: CachedRequestData
    ) -> None:
        """Take an already scheduled running request back out of the step."""
        if num_scheduled_tokens.pop(victim.request_id, 0):
            position = cached.req_ids.index(victim.request_id)
            del cached.req_ids[position]
            del cached.new_block_ids[position]
            del cached.num_computed_tokens[position]
            if cached.new_group_block_ids:
                del cached.new_group_block_ids[position]

    # ---- update_from_output: the worker's answer ------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one step's results: advance counts, cache full blocks, append tokens, stop, free.

        The caller passes the worker's answer to each ``schedule()`` output
        exactly once, in step order, with that output (ValueError on a step id
        mismatch). Results for requests that finished, were aborted or were
        preempted since they were scheduled are dropped.

        Returns one RequestOutput per request that got tokens (in scheduling
        order), then one per request the worker failed. Requests that finished
        here (EOS, stop token, length, worker error) have released their
        blocks and are in the next step's ``finished_req_ids``. An output's
        ``new_token_ids`` may be a list of ``model_runner_output`` itself:
        mutate neither.
        """
        if model_runner_output.step_id != scheduler_output.step_id:
            raise ValueError(
                f"worker output is for step {model_runner_output.step_id}, "
                f"expected step {scheduler_output.step_id}"
            )
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        if self._in_flight_ids:
            self._in_flight_ids.difference_update(scheduler_output.num_scheduled_tokens)
        if self.connector is not None:
            self._update_from_connector(model_runner_output.kv_connector_output)
        self._advance_scheduled(scheduler_output, model_runner_output, outputs, finished)
        if model_runner_output.errors:
            self._fail_in_worker(model_runner_output.errors, outputs, finished)
        if finished:
            self._retire(finished)
        return outputs

    def _advance_scheduled(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        outputs: list[RequestOutput],
        finished: list[Request],
    ) -> None:
        """Per scheduled request: count its computed tokens, register blocks they
        fill, append what the worker sampled and check whether it stops."""
        requests = self.requests
        cache_full_blocks = self.kv_cache_manager.cache_full_blocks
        max_model_len = self.config.max_model_len
        errors = model_runner_output.errors
        drafts = scheduler_output.scheduled_spec_decode_tokens
        req_ids = model_runner_output.req_ids
        sampled_by_id = dict(zip(req_ids, model_runner_output.sampled_token_ids, strict=True))
        logprobs_by_id = (
            dict(zip(req_ids, model_runner_output.logprobs, strict=True))
            if model_runner_output.logprobs
            else None
        )
        if model_runner_output.prompt_logprobs:
            self._collect_prompt_logprobs(model_runner_output.prompt_logprobs)
        now: float | None = None
        # Async mode: num_computed_tokens already counts later steps, so this
        # step's end is its start (as sent to the worker) plus its tokens.
        computed_before = (
            self._computed_before(scheduler_output) if self.config.async_scheduling else None
        )

        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None or request.status is not _RUNNING:
                # Aborted or finished by a stop string since schedule(); in async
                # mode also finished, preempted or failed by the previous step.
                continue
            if errors and request_id in errors:
                continue  # _fail_in_worker
            if request.sampling_params.pooling is not None:
                self._finish_pooled(request, model_runner_output.pooled, outputs, finished)
                continue
            token_ids = sampled_by_id.get(request_id)
            request_drafts = drafts.get(request_id) if drafts else None
            if request_drafts:
                # Rejected drafts were computed but hold KV of wrong tokens:
                # they do not count, and their blocks are cached only once the
                # accepted tokens are appended (below).
                num_tokens -= self._record_verification(request_id, request_drafts, token_ids)
            if computed_before is None:
                num_computed = request.num_computed_tokens = (
                    request.num_computed_tokens + num_tokens
                )
            else:
                num_computed = computed_before[request_id] + num_tokens
            if not request_drafts:
                cache_full_blocks(request, num_computed)
            if not token_ids:
                continue
            # The last known token (and the accepted drafts) are computed; the
            # token sampled after them is not.
            num_accepted = len(token_ids) - 1 if request_drafts else 0
            if num_computed != len(request.all_token_ids) + num_accepted:
                self._log_early_sample(request, num_computed)
                continue
            if computed_before is not None:
                request.num_output_placeholders -= 1
            num_appended = request.append_output_token_ids(token_ids, max_model_len)
            if num_appended < len(token_ids):
                token_ids = token_ids[:num_appended]
            stopped = request.status is not _RUNNING  # a token finished it
            if request_drafts:
                self._settle_drafted_blocks(request, num_computed, stopped)
            if request.first_token_time is None:
                if now is None:
                    now = self.clock()
                request.first_token_time = now
            logprobs = logprobs_by_id.get(request_id) if logprobs_by_id else None
            if logprobs and len(logprobs) > len(token_ids):
                logprobs = logprobs[: len(token_ids)]
            # Positional: keywords make this call ~2x slower, and every request takes it.
            output = RequestOutput(
                request_id,
                token_ids,  # new_token_ids
                request.status.finish_reason if stopped else None,
                request.stop_reason,
                logprobs or None,  # new_logprobs
                request.num_prompt_tokens,
                request.num_cached_tokens,
            )
            if request.prompt_logprobs is not None:
                # The first token: the whole prompt is scored by now.
                output.prompt_logprobs = request.prompt_logprobs
                request.prompt_logprobs = None
            outputs.append(output)
            if stopped:
                finished.append(request)

    def _finish_pooled(
        self,
        request: Request,
        pooled: dict[str, bytes],
        outputs: list[RequestOutput],
        finished: list[Request],
    ) -> None:
        """A pooling request's one step is done: finish it with its pooled vector."""
        data = pooled.get(request.request_id)
        if data is None:
            # The worker broke its contract (no vector, no error): fail it, not the step.
            self._fail_in_worker(
                {request.request_id: "worker returned no pooled output"}, outputs, finished
            )
            return
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.FINISHED_STOPPED
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        output = RequestOutput(
            request.request_id,
            [],
            request.status.finish_reason,
            None,
            None,
            request.num_prompt_tokens,
            0,
        )
        output.pooled_data = data
        outputs.append(output)
        finished.append(request)

    def _record_verification(
        self, request_id: str, request_drafts: list[int], token_ids: list[int] | None
    ) -> int:
        """Count a verification's outcome; returns how many drafts were rejected.

        The worker answers the accepted drafts plus one token: all drafts
        rejected when it answered nothing (its contract broken, logged later).
        """
        num_drafts = len(request_drafts)
        num_accepted = min(max(len(token_ids) - 1, 0), num_drafts) if token_ids else 0
        assert self.speculator is not None
        self.speculator.record(request_id, num_drafts, num_accepted, self._step_id)
        return num_drafts - num_accepted

    def _settle_drafted_blocks(self, request: Request, num_computed: int, stopped: bool) -> None:
        """After a verification: cache the blocks the accepted tokens fill, free the
        tail that only rejected drafts needed (the worker drops the same tail).

        Tokens after a stop were dropped: their KV is never cached.
        """
        kv = self.kv_cache_manager
        kv.cache_full_blocks(request, min(num_computed, request.num_tokens))
        if not stopped:
            # Room for the known tokens, i.e. up to the one sampled this step.
            kv.free_excess_blocks(request, request.num_tokens)

    def _collect_prompt_logprobs(self, runs: list[PromptLogprobs]) -> None:
        """Store the prompt positions the worker scored until the first token takes them.

        A request recomputing its prompt after a preemption (before its first
        token) overwrites the same positions with the same values.
        """
        for run in runs:
            request = self.requests.get(run.req_id)
            if request is None or request.prompt_logprobs is None:
                continue  # finished meanwhile, or its prompt logprobs already left
            stored = request.prompt_logprobs
            start = run.start_position - 1
            if start < 0 or start + len(run.entries) > len(stored):
                logger.warning(
                    "request %s: prompt logprobs for positions %s..%s outside its prompt",
                    run.req_id,
                    run.start_position,
                    run.start_position + len(run.entries) - 1,
                )
                continue
            stored[start : start + len(run.entries)] = run.entries

    def _update_from_connector(self, output: KVConnectorOutput) -> None:
        """Confirmed saves; finished loads rejoin the waiting queue (loaded blocks cached)."""
        connector = self.connector
        assert connector is not None
        connector.update_connector_output(output)
        kv = self.kv_cache_manager
        for request_id, num_loaded_blocks in output.finished_loads.items():
            load = connector.finish_load(request_id, num_loaded_blocks)
            if load is None:
                continue  # cancelled (aborted), or from a worker before a reset
            request = self.waiting_for_remote_kvs.pop(request_id)
            num_loaded = min(num_loaded_blocks, len(load.block_hashes))
            # The loaded blocks enter the prefix cache like computed ones and go
            # back with the rest; re-admission at the front of the queue finds
            # them as local hits (evicted meanwhile only under memory pressure,
            # which costs recomputation, never correctness).
            request.num_computed_tokens = (
                load.num_local_computed_tokens + num_loaded * self.config.block_size
            )
            kv.cache_full_blocks(request, request.num_computed_tokens)
            kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)

    def release_remote_loads(self) -> list[str]:
        """The worker is gone, and with it every load in flight: free their blocks,
        requeue the requests that waited for them. Returns their ids."""
        if self.connector is None:
            return []
        self.connector.reset()
        ids = list(self.waiting_for_remote_kvs)
        for request in self.waiting_for_remote_kvs.values():
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)
        self.waiting_for_remote_kvs.clear()
        return ids

    def requeue_after_worker_loss(self) -> list[Request]:
        """The worker died, and every KV block with it: migrate its requests.

        Running requests go back to the front of the waiting queue in admission
        order, like preempted ones, each with ``num_migrations`` counted; loads
        in flight are requeued too. The prefix cache is emptied (its hashes
        would promise KV the new worker does not have), and the new worker
        holds no request, so there is nothing left for it to drop. Returns the
        running requests requeued.
        """
        moved, self.running = self.running, []
        for request in reversed(moved):
            self._requeue(request)
            request.num_migrations += 1
        self.release_remote_loads()
        self._finished_req_ids.clear()
        self._in_flight_ids.clear()  # those steps' answers never come
        self.reset_prefix_cache()
        if moved:
            logger.warning("worker lost: %d running requests requeued", len(moved))
        return moved

    @staticmethod
    def _log_early_sample(request: Request, num_computed: int) -> None:
        """A token sampled before the end of the known tokens breaks the step contract."""
        logger.warning(
            "request %s: worker sampled before the end of its tokens (%s of %s computed); ignored",
            request.request_id,
            num_computed,
            request.num_tokens,
        )

    def _fail_in_worker(
        self, errors: dict[str, str], outputs: list[RequestOutput], finished: list[Request]
    ) -> None:
        """Finish the requests the worker failed with FINISHED_ERROR, one output each."""
        requests = self.requests
        for request_id, message in errors.items():
            request = requests.get(request_id)
            if request is None or request.status != _RUNNING:
                continue  # the worker only holds running requests
            logger.warning("request %s failed in the worker: %s", request_id, message)
            request.error = message
            request.status = RequestStatus.FINISHED_ERROR
            finished.append(request)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=request.status.finish_reason,
                    stop_reason=None,
                    new_logprobs=None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    error=message,
                )
            )

    @staticmethod
    def _computed_before(scheduler_output: SchedulerOutput) -> dict[str, int]:
        """req_id -> num_computed_tokens at the start of the step, as the worker was told."""
        cached = scheduler_output.scheduled_cached_reqs
        computed_before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            computed_before[new.req_id] = new.num_computed_tokens
        return computed_before

    def _retire(self, finished: list[Request]) -> None:
        """Free running requests that finished in update_from_output (status set)."""
        for request in finished:
            self._finish(request, request.status, held_by_worker=True)
        self.running = [r for r in self.running if r.status == _RUNNING]

    # ---- views --------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.waiting_for_remote_kvs)

    def has_connector_work(self) -> bool:
        """A step must go to the worker even with nothing to compute: loads or
        saves are planned, or a load in flight must be collected."""
        return self.connector is not None and self.connector.has_pending_work()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_blocks(self, max_looked_up: int = 64) -> int:
        """KV blocks the queued requests would take once admitted, less their
        cached prefixes. The cache is looked up for the first ``max_looked_up``
        of them only (a load report must stay cheap behind a long queue); the
        rest count in full."""
        block_size = self.config.block_size
        total = 0
        for position, request in enumerate(self.waiting):
            if position < max_looked_up:
                total += self.kv_cache_manager.num_blocks_to_allocate(request)
            else:
                total += cdiv(request.num_tokens, block_size)
        return total

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return len(self.waiting_for_remote_kvs)

    def live_request_ids(self) -> list[str]:
        """Ids of every unfinished request (waiting, running or preempted)."""
        return list(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Block invariants plus queue invariants; for tests and debug builds."""
        # Only running requests and loads in flight hold blocks.
        loading = list(self.waiting_for_remote_kvs.values())
        # Pooling requests run without blocks.
        holders = [r for r in self.running if r.sampling_params.pooling is None]
        self.kv_cache_manager.check_integrity(holders=[*holders, *loading])
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        loading_ids = list(self.waiting_for_remote_kvs)
        all_ids = running_ids + waiting_ids + loading_ids
        if len(set(all_ids)) != len(all_ids):
            raise KVCacheIntegrityError("a request is queued twice")
        if set(all_ids) != set(self.requests):
            raise KVCacheIntegrityError("request table and queues disagree")
        for request in self.waiting_for_remote_kvs.values():
            if request.status is not _WAITING_FOR_REMOTE_KVS:
                raise KVCacheIntegrityError(f"{request} is loading with a wrong status")
        if self.connector is not None and any(
            not self.connector.is_loading(r.request_id) for r in loading
        ):
            raise KVCacheIntegrityError("a request holds blocks for a load nobody runs")
        for request in self.running:
            if request.status != _RUNNING:
                raise KVCacheIntegrityError(f"{request} is running with a wrong status")
            if self.config.num_micro_batches > 1 and request.num_output_placeholders > 1:
                raise KVCacheIntegrityError(f"{request} is in two micro-batches at once")
        for request in self.waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise KVCacheIntegrityError(f"{request} is waiting with a wrong status")
        adapters = {r.lora_request.lora_id for r in self.running if r.lora_request is not None}
        if len(adapters) > self.config.max_loras:
            raise KVCacheIntegrityError(
                f"{len(adapters)} adapters running, the worker has {self.config.max_loras} slots"
            )

    def make_stats(self) -> SchedulerStats:
        """Gauges now, counters since the previous call."""
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            finished_requests=self._finished_stats,
            num_waiting_for_remote_kvs=len(self.waiting_for_remote_kvs),
            kv_connector=self.connector.make_stats() if self.connector is not None else None,
            spec_decoding=self.speculator.make_stats() if self.speculator is not None else None,
        )
        self._prefix_cache_queries = self._prefix_cache_hits = self._num_preemptions = 0
        self._finished_stats = []
        return stats
