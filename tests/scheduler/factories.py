"""One-line factories for scheduler tests and benchmarks/scheduler_bench.py.

``make_output`` plays the worker: it samples only for requests that reach the
end of their known tokens in the step, exactly as the step contract says.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvmesh.scheduler.config import SchedulerConfig
from kvmesh.scheduler.output import RequestOutput
from kvmesh.scheduler.request import Request
from kvmesh.scheduler.scheduler import Scheduler
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import ModelRunnerOutput, SchedulerOutput

_ids = itertools.count()

# Token the fake worker samples when a test does not say which one.
DEFAULT_SAMPLED_TOKEN = 7


def make_scheduler(clock: Callable[[], float] | None = None, **config: Any) -> Scheduler:
    """A scheduler with a roomy default pool; override any SchedulerConfig field."""
    config.setdefault("num_kv_blocks", 1024)
    scheduler_config = SchedulerConfig(**config)
    if clock is None:
        return Scheduler(scheduler_config)
    return Scheduler(scheduler_config, clock=clock)


def make_request(
    n_prompt: int,
    max_tokens: int = 16,
    *,
    request_id: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (2,),
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    parallel_group: str | None = None,
    lora_request: LoRARequest | None = None,
    **sampling: object,
) -> Request:
    """A request with ``n_prompt`` prompt tokens, unique to it unless given (so
    that tests share prefixes only on purpose)."""
    serial = next(_ids)
    if prompt_token_ids is None:
        start = 1_000 + serial * 10_000
        prompt_token_ids = range(start, start + n_prompt)
    return Request(
        request_id=request_id if request_id is not None else f"req-{serial}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        parallel_group=parallel_group,
        lora_request=lora_request,
    )


def make_output(
    scheduler_output: SchedulerOutput,
    tokens: Mapping[str, int] | None = None,
    errors: Mapping[str, str] | None = None,
    *,
    scheduler: Scheduler,
) -> ModelRunnerOutput:
    """The worker's answer: one token (``tokens[id]`` or a default) for each
    request whose computed tokens reach its known tokens this step."""
    tokens = tokens or {}
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, ()))
        reaches_end = request.num_computed_tokens + num_scheduled == request.num_tokens + num_drafts
        req_ids.append(request_id)
        sampled.append([tokens.get(request_id, DEFAULT_SAMPLED_TOKEN)] if reaches_end else [])
    return ModelRunnerOutput(
        step_id=scheduler_output.step_id,
        req_ids=req_ids,
        sampled_token_ids=sampled,
        errors=dict(errors or {}),
    )


def make_spec_output(
    scheduler_output: SchedulerOutput,
    num_accepted: Mapping[str, int],
    bonus_token: int = DEFAULT_SAMPLED_TOKEN,
    *,
    scheduler: Scheduler,
) -> ModelRunnerOutput:
    """``make_output`` for a step with drafts: request r keeps its first
    ``num_accepted[r]`` drafts (all when absent) and then samples ``bonus_token``
    (as every sampling request without drafts does)."""
    output = make_output(scheduler_output, scheduler=scheduler)
    for index, request_id in enumerate(output.req_ids):
        if not output.sampled_token_ids[index]:
            continue
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
        kept = drafts[: num_accepted.get(request_id, len(drafts))]
        output.sampled_token_ids[index] = [*kept, bonus_token]
    return output


def run_step(
    scheduler: Scheduler,
    tokens: Mapping[str, int] | None = None,
    errors: Mapping[str, str] | None = None,
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """schedule() + a fabricated worker answer + update_from_output()."""
    scheduler_output = scheduler.schedule()
    model_output = make_output(scheduler_output, tokens, errors, scheduler=scheduler)
    return scheduler_output, scheduler.update_from_output(scheduler_output, model_output)


# (request id, prompt, max_tokens, ignore_eos, arrival step) of a random workload.
WorkloadSpec = tuple[str, list[int], int, bool, int]


def random_workload(
    rng: random.Random, block_size: int
) -> tuple[list[WorkloadSpec], dict[str, Any]]:
    """A few requests (some sharing a prefix) arriving over the first steps, and a
    scheduler config small enough to preempt, chunk and hit the prefix cache."""
    shared = [rng.randrange(10, 1000) for _ in range(12)]
    specs: list[WorkloadSpec] = []
    for index in range(rng.randint(4, 10)):
        n_prompt = rng.randint(1, 14)
        prompt = (
            shared[:n_prompt]
            if rng.random() < 0.3
            else [rng.randrange(10, 1000) for _ in range(n_prompt)]
        )
        specs.append(
            (f"r{index}", prompt, rng.randint(1, 12), rng.random() < 0.5, rng.randint(0, 6))
        )
    config = dict(
        num_kv_blocks=rng.choice([6, 8, 12, 64]),
        block_size=block_size,
        max_model_len=24,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([5, 9, 32]),
        long_prefill_token_threshold=rng.choice([0, 5]),
        enable_prefix_caching=rng.random() < 0.7,
        watermark=0.0,
    )
    return specs, config
