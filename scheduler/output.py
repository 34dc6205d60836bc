"""What the scheduler reports back: per-request deltas and periodic stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.services.contracts.step import Logprobs

if TYPE_CHECKING:  # kv_connector imports request, which imports this module
    from kvmesh.scheduler.kv_connector import KVConnectorStats
    from kvmesh.scheduler.spec_decode.speculator import SpecDecodingStats


@dataclass
class RequestOutput:
    """New tokens of one request from one step (and how it ended, if it did)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    # Token id from stop_token_ids that ended the request; None for EOS or length.
    stop_reason: int | None
    new_logprobs: list[Logprobs] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # On the first output of a request with prompt_logprobs set: entry i scores
    # prompt token i + 1 (None only for a position the worker never scored).
    prompt_logprobs: list[Logprobs | None] | None = None
    # A pooling request's result (little-endian float32) on its final output.
    pooled_data: bytes = b""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class FinishedRequestStats:
    """Latency breakdown of one finished request, in seconds.

    A phase the request never reached (aborted while waiting, no token yet) is None.
    """

    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generation_tokens: int
    # arrival -> first scheduled (vllm:request_queue_time_seconds)
    queue_time: float | None
    # first scheduled -> first token (vllm:request_prefill_time_seconds)
    prefill_time: float | None
    # first token -> finished (vllm:request_decode_time_seconds)
    decode_time: float | None


@dataclass
class SchedulerStats:
    """A snapshot for metrics; counters cover the time since the previous snapshot."""

    num_running: int
    num_waiting: int
    # Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc).
    kv_cache_usage: float
    # Tokens looked up in / found in the prefix cache when requests were admitted.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # KV connector (None when off): requests waiting for their KV load, and
    # the connector's counters since the previous snapshot.
    num_waiting_for_remote_kvs: int = 0
    kv_connector: KVConnectorStats | None = None
    # Speculative decoding's counters since the previous snapshot (None when off).
    spec_decoding: SpecDecodingStats | None = None
