"""The per-step contract between the scheduler and the worker.

One ``SchedulerOutput`` describes one engine step: which requests advance and
by how many tokens. A request's full data travels once (``NewRequestData``,
also when it resumes after preemption); afterwards only deltas travel
(``CachedRequestData``). The worker answers each step with one
``ModelRunnerOutput``. These dataclasses are what the scheduler and worker
cores use in process; ``services/contracts/step_codec.py`` maps them to protobuf for the
wire, so an in-process engine and the gRPC stack run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the worker needs about a request it does not hold yet."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a brand-new request);
    # the worker's view of the sequence is prompt + output.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Physical KV block ids, in logical order (KV-cache group 0's with several
    # groups, services/contracts/kv_cache_groups.py). A sliding-window group's
    # blocks before its window are the null block (id 0), never read.
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hits).
    num_computed_tokens: int
    # The adapter the request runs with; None for the base model.
    lora_request: LoRARequest | None = None
    # The request's trace context (services/runtime/tracing.py) when it is traced;
    # empty otherwise. Set by the scheduler service, not its core.
    trace_context: dict[str, str] = field(default_factory=dict)
    # KV-cache groups 1..'s block ids, each like ``block_ids`` (one entry per
    # block of the request); empty for a model with one group.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Deltas for requests the worker already holds (columnar, one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's block table this step.
    new_block_ids: list[list[int]] = field(default_factory=list)
    # num_computed_tokens before this step, as the scheduler counts them.
    num_computed_tokens: list[int] = field(default_factory=list)
    # Several KV-cache groups only (empty otherwise): per request, the blocks
    # appended to groups 1..'s tables this step, as many per group as
    # ``new_block_ids`` has. Entries that left a window are not updated: the
    # kernels never read them.
    new_group_block_ids: list[list[list[int]]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class KVTransfer:
    """One request's blocks to move between the paged cache and the kvstore."""

    req_id: str
    # Physical block ids and their chained prefix-cache hashes (the store keys),
    # parallel lists in logical order.
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class KVConnectorMetadata:
    """The connector's work for one step, built by the scheduler-side connector.

    ``loads`` fill reserved blocks of requests waiting for remote KV; they run
    in the background and are reported back in ``KVConnectorOutput``.
    ``saves`` name full, computed blocks; the worker copies them out at the
    start of the step (before loads and the forward pass may overwrite them)
    and puts them into the store in the background.
    """

    loads: list[KVTransfer] = field(default_factory=list)
    saves: list[KVTransfer] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class KVConnectorOutput:
    """Connector work that finished since the previous step's output."""

    # req_id -> leading blocks of its load now in the cache (fewer than asked:
    # the rest is recomputed).
    finished_loads: dict[str, int] = field(default_factory=dict)
    # Hashes of blocks the store committed.
    saved_block_hashes: list[bytes] = field(default_factory=list)
    # Hashes of blocks whose save failed: with the saved ones, every hash a
    # step's saves named is settled once, so a wait for saves can end.
    failed_save_hashes: list[bytes] = field(default_factory=list)

    def is_empty(self) -> bool:
        return (
            not self.finished_loads and not self.saved_block_hashes and not self.failed_save_hashes
        )


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
    kv_connector_metadata: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    # Speculative decoding: req_id -> draft tokens to verify this step (only
    # requests with drafts). num_scheduled_tokens counts them: the request's
    # input ends with its last known token followed by the drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

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
class PromptLogprobs:
    """Logprobs of a run of one request's prompt tokens, computed in one step.

    ``entries[i]`` scores prompt token ``start_position + i`` given the tokens
    before it (its ``token_id`` is that prompt token); ``start_position >= 1``
    since the first prompt token has nothing before it.
    """

    req_id: str
    start_position: int
    entries: list[Logprobs]


@dataclass
class ModelRunnerOutput:
    """The worker's answer to one step.

    Only requests that reached the end of their known tokens sample; a request
    still in the middle of a chunked prefill gets an empty list. A request that
    verified draft tokens gets its accepted drafts plus one sampled token.
    """

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Empty when no request of the step asked for logprobs; otherwise parallel
    # to req_ids, entry i parallel to sampled_token_ids[i] (empty where the
    # request asked for none).
    logprobs: list[list[Logprobs]] = field(default_factory=list)
    # Requests that failed inside the worker (bad params, kernel error):
    # req_id -> message. The scheduler finishes them with an error; the rest of
    # the batch is unaffected.
    errors: dict[str, str] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    # Prompt logprobs computed this step (requests with prompt_logprobs set
    # whose prompt was computed in this step).
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Pooling runner: req_id -> pooled output (little-endian float32) of each
    # pooling request of the step; such a request is finished by the step and
    # is not in req_ids.
    pooled: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def make_empty(cls, step_id: int = 0) -> ModelRunnerOutput:
        return cls(step_id=step_id, req_ids=[], sampled_token_ids=[])
