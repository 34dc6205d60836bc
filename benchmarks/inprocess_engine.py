"""kvmesh's engine without services: the real Scheduler driving a ModelRunner in one process.

No gRPC, protobuf, detokenizer or HTTP: one ``schedule()``, one
``execute_model()`` and one ``update_from_output()`` per step, synchronously.
This is the ceiling the full stack is measured against (baseline (b) of
``benchmarks/baselines.py``); it lives here because the scheduler package must
never load a model and the worker package must never decide what to run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from services.config import SpeculativeConfig
from services.lora_request import LoRARequest
from services.sampling_params import SamplingParams
from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    request_id: str
    output_token_ids: list[int]
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


class InProcessEngine:
    """Scheduler + ModelRunner, stepped by the caller."""

    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        lora_slots = runner.lora_slots
        self.runner = runner
        model_config, cache_config = runner.model_config, runner.cache_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=min(
                    model_config.max_model_len, runner.num_kv_blocks * cache_config.block_size
                ),
                block_size=cache_config.block_size,
                num_kv_blocks=runner.num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                speculative=speculative,
                max_loras=lora_slots.max_loras if lora_slots is not None else 0,
            )
        )
        self.eos_token_ids = runner.model_config.eos_token_ids
        self.results: dict[str, GenerationResult] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        now = time.monotonic()
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=now,
                lora_request=lora_request,
            )
        )
        self.results[request_id] = GenerationResult(request_id, [], now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[str]:
        """Run one engine step; returns the ids of requests that finished in it."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.monotonic()
        finished: list[str] = []
        for output in outputs:
            result = self.results[output.request_id]
            if output.new_token_ids and result.first_token_time is None:
                result.first_token_time = now
            result.output_token_ids.extend(output.new_token_ids)
            if output.finish_reason is not None:
                result.finish_time = now
                finished.append(output.request_id)
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_concurrency: int,
    ) -> list[GenerationResult]:
        """Run every prompt with at most ``max_concurrency`` in the engine at once."""
        pending = list(enumerate(prompts))[::-1]
        num_live = 0
        while pending or self.has_unfinished_requests():
            while pending and num_live < max_concurrency:
                index, prompt = pending.pop()
                self.add_request(f"req-{index}", prompt, params)
                num_live += 1
            num_live -= len(self.step())
        return [self.results[f"req-{index}"] for index in range(len(prompts))]
