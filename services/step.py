"""The per-step contract between the scheduler and the worker.

One ``SchedulerOutput`` describes one engine step: which requests advance and
by how many tokens. A request's full data travels once (``NewRequestData``,
also when it resumes after preemption); afterwards only deltas travel
(``CachedRequestData``). The worker answers each step with one
``ModelRunnerOutput``. These dataclasses are what the scheduler and worker
cores use in process; ``services/step_codec.py`` maps them to protobuf for the
wire, so an in-process engine and the gRPC stack run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the worker needs about a request it does not hold yet."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a brand-new request);
    # the worker's view of the sequence is prompt + output.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Physical KV block ids, in logical order.
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hits).
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Deltas for requests the worker already holds (columnar, one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's block table this step.
    new_block_ids: list[list[int]] = field(default_factory=list)
    # num_computed_tokens before this step, as the scheduler counts them.
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One engine step, from scheduler to worker."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (new and cached requests alike).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must drop (finished, aborted or preempted) before
    # running this step; their blocks may be reused by this very step.
    finished_req_ids: set[str]

    @classmethod
    def make_empty(cls, step_id: int = 0) -> SchedulerOutput:
        return cls(
            step_id=step_id,
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=set(),
        )


@dataclass
class Logprobs:
    """Log-probabilities of one sampled token (raw logits, before processing)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the raw distribution
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """The worker's answer to one step.

    Only requests that reached the end of their known tokens sample; a request
    still in the middle of a chunked prefill gets an empty list.
    """

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Parallel to req_ids; None where logprobs were not requested.
    logprobs: list[Logprobs | None] = field(default_factory=list)
    # Requests that failed inside the worker (bad params, kernel error):
    # req_id -> message. The scheduler finishes them with an error; the rest of
    # the batch is unaffected.
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def make_empty(cls, step_id: int = 0) -> ModelRunnerOutput:
        return cls(step_id=step_id, req_ids=[], sampled_token_ids=[])
