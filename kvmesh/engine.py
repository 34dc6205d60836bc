"""kvmesh's engine without services: the real Scheduler driving a ModelRunner in one process.

No gRPC, protobuf, detokenizer or HTTP: one ``schedule()``, one
``execute_model()`` and one ``update_from_output()`` per step, synchronously;
or, with micro-batches (a pipeline-parallel replica through
``kvmesh.worker.parallel.driver.BroadcastingRunner``), up to one begun step per
stage, each finished once the pipeline is full or nothing else can begin.
This is the ceiling the full stack is measured against (baseline (b) of
``benchmarks/baselines.py``) and the engine under ``kvmesh.LLM``; it lives here,
above the services, because the scheduler package must never load a model and
the worker package must never decide what to run.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.output import RequestOutput
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.services.contracts.kv_cache_groups import longest_fitting_len
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput
from kvmesh.services.runtime.config import SpeculativeConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.step_in_flight import StepInFlight

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """One request's tokens so far and, once it ended, why."""

    request_id: str
    output_token_ids: list[int]
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    # The OpenAI finish reason ("stop", "length", "abort", "error") once finished.
    finish_reason: str | None = None
    # The stop_token_ids entry that ended the request (None for EOS, length, a stop string).
    stop_reason: int | None = None


class InProcessEngine:
    """Scheduler + ModelRunner, stepped by the caller."""

    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
        num_micro_batches: int = 1,
    ) -> None:
        """``runner``: a ModelRunner, or a BroadcastingRunner for a parallel replica
        (its steps begin and finish like the driver's); ``num_micro_batches`` > 1
        keeps that many steps begun (pipeline overlap)."""
        lora_slots = runner.lora_slots
        self.runner = runner
        model_config, cache_config = runner.model_config, runner.cache_config
        # Per KV-cache group its window: block arithmetic is per group.
        windows = tuple(group.sliding_window for group in runner.kv_cache_groups)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=longest_fitting_len(
                    windows,
                    model_config.max_model_len,
                    runner.num_kv_blocks,
                    cache_config.block_size,
                    max_num_batched_tokens,
                ),
                kv_cache_windows=windows,
                block_size=cache_config.block_size,
                num_kv_blocks=runner.num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                speculative=speculative,
                max_loras=lora_slots.max_loras if lora_slots is not None else 0,
                async_scheduling=num_micro_batches > 1,
                num_micro_batches=num_micro_batches,
            )
        )
        self._begun: deque[tuple[SchedulerOutput, StepInFlight]] = deque()
        self.eos_token_ids = runner.model_config.eos_token_ids
        self.results: dict[str, GenerationResult] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        parallel_group: str | None = None,
    ) -> None:
        """``parallel_group``: shared by the samples of one prompt (n > 1), so the
        scheduler computes the prompt once and the others hit its cache."""
        now = time.monotonic()
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=now,
                lora_request=lora_request,
                parallel_group=parallel_group,
            )
        )
        self.results[request_id] = GenerationResult(request_id, [], now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._begun)

    def step(self) -> list[str]:
        """Run one engine step; returns the ids of requests that finished in it."""
        return [output.request_id for output in self.step_outputs() if output.finished]

    def step_outputs(self) -> list[RequestOutput]:
        """Run one engine step; returns every request's new tokens from it (and how
        those that ended, ended), as the scheduler service publishes them."""
        if self.scheduler.config.num_micro_batches > 1:
            return self._pipelined_step()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def finish_stopped(self, request_id: str) -> None:
        """End a request whose text hit a stop string (the detokenizer's ask of
        the scheduler in the stack); its blocks are freed at once."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
        result = self.results[request_id]
        result.finish_reason = FinishReason.STOP.value
        result.finish_time = time.monotonic()

    def _pipelined_step(self) -> list[RequestOutput]:
        """Begin the next micro-batch if the pipeline has room; finish the oldest
        once it is full or nothing else began (the worker service's policy when
        steps arrive faster than the last stage hands them back)."""
        depth = self.scheduler.config.steps_in_flight
        begun = False
        if len(self._begun) < depth and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids:
                self._begun.append((scheduler_output, self.runner.begin_step(scheduler_output)))
                begun = True
        if not self._begun or (begun and len(self._begun) < depth):
            return []
        scheduler_output, step = self._begun.popleft()
        return self._apply(scheduler_output, self.runner.finish_step(step))

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.monotonic()
        for output in outputs:
            result = self.results[output.request_id]
            if output.new_token_ids and result.first_token_time is None:
                result.first_token_time = now
            result.output_token_ids.extend(output.new_token_ids)
            if output.finish_reason is not None:
                result.finish_time = now
                result.finish_reason = output.finish_reason.value
                result.stop_reason = output.stop_reason
        return outputs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_concurrency: int,
        lora_requests: Sequence[LoRARequest | None] = (),
    ) -> list[GenerationResult]:
        """Run every prompt with at most ``max_concurrency`` in the engine at once;
        ``lora_requests``: per prompt, its adapter (None or missing: the base model)."""
        pending = list(enumerate(prompts))[::-1]
        num_live = 0
        while pending or self.has_unfinished_requests():
            while pending and num_live < max_concurrency:
                index, prompt = pending.pop()
                lora = lora_requests[index] if index < len(lora_requests) else None
                self.add_request(f"req-{index}", prompt, params, lora_request=lora)
                num_live += 1
            num_live -= len(self.step())
        return [self.results[f"req-{index}"] for index in range(len(prompts))]
