"""One request's scheduling state, counted in tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.scheduler.stopping import check_stop
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import Logprobs


class Request:
    """A prompt, the tokens generated so far, and how many have KV computed.

    ``num_tokens - num_computed_tokens`` is what is left to compute; there is no
    separate prefill or decode state. Timestamps come from the scheduler's clock
    (``arrival_time`` from whoever built the request, on the same clock).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_ids",
        "error",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "lora_request",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_migrations",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "parallel_group",
        "priority",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int],
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        parallel_group: str | None = None,
        resumed_output_token_ids: Sequence[int] = (),
        num_migrations: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Every end-of-sequence id of the model (config.json and
        # generation_config.json): any of them stops the request.
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Shared by the n > 1 samples of one prompt; see Scheduler._defer_sibling.
        self.parallel_group = parallel_group
        # The adapter it runs with (None: the base model): part of its block
        # hashes, and counted against SchedulerConfig.max_loras per step.
        self.lora_request = lora_request

        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # A continuation (request migration) starts with the tokens it already
        # generated elsewhere: limits and stop checks count from the original start.
        self.output_token_ids: list[int] = list(resumed_output_token_ids)
        # prompt + output, kept as one list so blocks can be hashed by slicing.
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Async scheduling only: tokens the worker samples in steps already
        # scheduled whose ids the scheduler has not seen yet. They count as
        # computed (their slot is scheduled) but are not in all_token_ids.
        self.num_output_placeholders = 0
        # Prefix-cache hit tokens at first scheduling (reported to the client).
        self.num_cached_tokens = 0
        # Hashes of the full blocks of all_token_ids, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        # Token id that stopped the request (stop_token_ids), else None.
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        # Times it lost the stage that ran it and resumed (scheduler/migration.py).
        self.num_migrations = num_migrations
        # SamplingParams.prompt_logprobs set: entry i holds the logprobs of
        # prompt token i + 1 as the worker reports them chunk by chunk; they
        # leave with the first output token (None from then on).
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] * (self.num_prompt_tokens - 1)
            if sampling_params.prompt_logprobs is not None
            else None
        )

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int], max_model_len: int) -> int:
        """Append sampled tokens in order until one finishes the request.

        The per-token path of every step. ``check_stop`` runs after each token;
        its verdict sets the finished status (and stop reason), and tokens after
        the one that stopped the request are dropped. Returns how many were
        appended: ``len(token_ids)`` unless the request finished early.
        """
        output_token_ids = self.output_token_ids
        all_token_ids = self.all_token_ids
        params, eos_token_ids = self.sampling_params, self.eos_token_ids
        num_appended = 0
        for token_id in token_ids:
            output_token_ids.append(token_id)
            all_token_ids.append(token_id)
            num_appended += 1
            stop = check_stop(
                params, output_token_ids, len(all_token_ids), eos_token_ids, max_model_len
            )
            if stop is not None:
                self.status, stop_token_id = stop
                if stop_token_id is not None:
                    self.stop_reason = stop_token_id
                break
        return num_appended

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
