"""A minimal in-process stand-in for the scheduler, for tests and benchmarks.

It hands out blocks from a free list, schedules every unfinished request each
step (optionally in chunks of at most ``chunk_size`` tokens) and sends new
requests once, deltas afterwards, exactly as the step contract says. It has no
token budget, preemption or prefix-cache hashing: that is ``scheduler/``'s job.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import (
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvmesh.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class DriverRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_new_tokens: int
    block_ids: list[int]
    num_computed_tokens: int = 0
    # Blocks this driver allocated (shared prefix blocks are not freed by it).
    owned_block_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    # Prompt position -> that prompt token's logprobs (prompt_logprobs set).
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)
    sent: bool = False
    error: str | None = None
    lora_request: LoRARequest | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.error is not None or len(self.output_token_ids) >= self.max_new_tokens


class LocalDriver:
    """Drives a ModelRunner with hand-built SchedulerOutputs."""

    def __init__(
        self, runner: ModelRunner, chunk_size: int | None = None, free_on_finish: bool = True
    ) -> None:
        self.runner = runner
        self.block_size = runner.cache_config.block_size
        self.chunk_size = chunk_size
        self.free_on_finish = free_on_finish
        self.free_blocks: deque[int] = deque(range(runner.num_kv_blocks))
        self.requests: dict[str, DriverRequest] = {}
        self.finished: dict[str, DriverRequest] = {}
        self._to_drop: set[str] = set()
        self._step_id = 0

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        max_new_tokens: int = 16,
        prefix_block_ids: list[int] | None = None,
        num_computed_tokens: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> DriverRequest:
        """Queue a request; ``prefix_block_ids`` are already-filled blocks it reuses."""
        prefix = list(prefix_block_ids or [])
        for block in prefix:
            if block in self.free_blocks:
                self.free_blocks.remove(block)
        request = DriverRequest(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params or SamplingParams(temperature=0.0),
            max_new_tokens=max_new_tokens,
            block_ids=prefix,
            num_computed_tokens=num_computed_tokens,
            lora_request=lora_request,
        )
        self.requests[req_id] = request
        return request

    def _allocate(self, request: DriverRequest, num_tokens: int) -> list[int]:
        needed = cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if needed > len(self.free_blocks):
            raise RuntimeError("LocalDriver ran out of KV blocks")
        new_blocks = [self.free_blocks.popleft() for _ in range(max(needed, 0))]
        request.block_ids.extend(new_blocks)
        request.owned_block_ids.extend(new_blocks)
        return new_blocks

    def build_step(self) -> SchedulerOutput:
        step = SchedulerOutput.make_empty(self._step_id)
        self._step_id += 1
        step.finished_req_ids = self._to_drop
        self._to_drop = set()
        for request in self.requests.values():
            remaining = request.num_tokens - request.num_computed_tokens
            num_scheduled = min(remaining, self.chunk_size or remaining)
            new_blocks = self._allocate(request, request.num_computed_tokens + num_scheduled)
            if not request.sent:
                step.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=request.req_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=list(request.block_ids),
                        num_computed_tokens=request.num_computed_tokens,
                        lora_request=request.lora_request,
                    )
                )
                request.sent = True
            else:
                cached = step.scheduled_cached_reqs
                cached.req_ids.append(request.req_id)
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(request.num_computed_tokens)
            step.num_scheduled_tokens[request.req_id] = num_scheduled
        step.total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
        return step

    def apply_output(self, step: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for req_id, message in output.errors.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.error = message
        for req_id, tokens, logprobs in zip(
            output.req_ids, output.sampled_token_ids, output.logprobs, strict=True
        ):
            request = self.requests[req_id]
            request.num_computed_tokens += step.num_scheduled_tokens[req_id]
            request.output_token_ids.extend(tokens)
            request.logprobs.extend(logprobs)
        for run in output.prompt_logprobs:
            entries = enumerate(run.entries, start=run.start_position)
            self.requests[run.req_id].prompt_logprobs.update(entries)
        for req_id in [r for r, req in self.requests.items() if req.is_finished]:
            request = self.requests.pop(req_id)
            self.finished[req_id] = request
            self._to_drop.add(req_id)
            if self.free_on_finish:
                self.free_blocks.extend(request.owned_block_ids)

    def step(self) -> ModelRunnerOutput:
        step = self.build_step()
        output = self.runner.execute_model(step)
        self.apply_output(step, output)
        return output

    def run(self, max_steps: int = 100_000) -> dict[str, DriverRequest]:
        """Step until every request finished; returns all finished requests by id."""
        for _ in range(max_steps):
            if not self.requests:
                break
            self.step()
        if self._to_drop:
            # Let the worker drop the last finishers too (an empty step).
            self.runner.execute_model(self.build_step())
        return self.finished
